//! memfd (shmem) regions: placed by their shared policy, sealable, shareable.

use std::fs::File;
use std::os::fd::AsFd;

use memfd::{HugetlbSize, MemfdOptions};
use rustix::fs::SealFlags;
use rustix::mm::{MapFlags, ProtFlags};

use super::map::round_len;
use super::{Backing, Region};
use crate::error::{Errno, Error, Result};
use crate::page::page_size;

/// A hugetlbfs page size for [`Region::memfd_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HugePageSize {
    /// 2 MiB pages.
    Size2M,
    /// 1 GiB pages.
    Size1G,
}

impl HugePageSize {
    /// Bytes per page.
    pub fn bytes(self) -> usize {
        match self {
            HugePageSize::Size2M => 2 << 20,
            HugePageSize::Size1G => 1 << 30,
        }
    }

    fn memfd(self) -> HugetlbSize {
        match self {
            HugePageSize::Size2M => HugetlbSize::Huge2MB,
            HugePageSize::Size1G => HugetlbSize::Huge1GB,
        }
    }

    /// Huge pages of this size that are free and not reserved
    /// (`/sys/kernel/mm/hugepages/hugepages-<kB>kB/{free,resv}_hugepages`); `None` when
    /// the kernel does not offer this size.
    pub fn available(self) -> Option<usize> {
        let dir = format!(
            "/sys/kernel/mm/hugepages/hugepages-{}kB",
            self.bytes() >> 10
        );
        let read = |name: &str| -> Option<usize> {
            std::fs::read_to_string(format!("{dir}/{name}"))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        Some(read("free_hugepages")?.saturating_sub(read("resv_hugepages").unwrap_or(0)))
    }
}

bitflags::bitflags! {
    /// memfd seals (`fcntl(F_ADD_SEALS)`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct Seals: u32 {
        /// `F_SEAL_SHRINK`: the file cannot shrink, so no mapping of it can SIGBUS.
        const SHRINK = 1 << 0;
        /// `F_SEAL_GROW`: the file cannot grow.
        const GROW = 1 << 1;
        /// `F_SEAL_WRITE`: no writes at all; refused while a writable mapping exists.
        const WRITE = 1 << 2;
        /// `F_SEAL_FUTURE_WRITE`: existing writable mappings keep working, new writes and
        /// writable mappings are refused, and holes can no longer be punched (Linux 5.1).
        const FUTURE_WRITE = 1 << 3;
        /// `F_SEAL_SEAL`: no more seals.
        const SEAL = 1 << 4;
    }
}

impl Seals {
    /// The seals that make a memfd's bytes immutable: no writes (and no writable shared
    /// mapping), no shrinking (no SIGBUS), no growing.
    pub const IMMUTABLE: Seals = Seals::WRITE.union(Seals::SHRINK).union(Seals::GROW);

    const KERNEL: [(Seals, SealFlags); 5] = [
        (Seals::SHRINK, SealFlags::SHRINK),
        (Seals::GROW, SealFlags::GROW),
        (Seals::WRITE, SealFlags::WRITE),
        (Seals::FUTURE_WRITE, SealFlags::FUTURE_WRITE),
        (Seals::SEAL, SealFlags::SEAL),
    ];

    fn to_kernel(self) -> SealFlags {
        Seals::KERNEL
            .iter()
            .filter(|(flag, _)| self.contains(*flag))
            .fold(SealFlags::empty(), |acc, (_, k)| acc | *k)
    }

    fn from_kernel(flags: SealFlags) -> Seals {
        Seals::KERNEL
            .iter()
            .filter(|(_, k)| flags.contains(*k))
            .fold(Seals::empty(), |acc, (flag, _)| acc | *flag)
    }
}

/// What [`Invalid::WrongBacking`](crate::error::Invalid::WrongBacking) says of a region
/// that is not a memfd.
const NOT_MEMFD: &str = "the region is not a memfd";

/// The seals of `file` (`F_GET_SEALS`).
fn file_seals(op: &'static str, file: &File) -> Result<Seals> {
    match rustix::fs::fcntl_get_seals(file) {
        Ok(flags) => Ok(Seals::from_kernel(flags)),
        Err(Errno::INVAL) => Err(Error::wrong_backing(
            op,
            "the file is not a memfd that allows sealing (F_GET_SEALS answered EINVAL)",
            "a sealed memfd: only one can be mapped without trusting every other process",
        )),
        Err(e) => Err(Error::os("fcntl", e, "F_GET_SEALS")),
    }
}

/// Adds `seals` to `file` unless it has them all already (`F_ADD_SEALS`).
fn add_seals(op: &'static str, file: &File, seals: Seals) -> Result<()> {
    if file_seals(op, file)?.contains(seals) {
        return Ok(());
    }
    rustix::fs::fcntl_add_seals(file, seals.to_kernel()).map_err(|e| match e {
        Errno::BUSY => Error::invalid(
            op,
            format!(
                "{seals:?}: F_SEAL_WRITE is refused (EBUSY) while a writable shared mapping \
                 of the memfd exists (here or in a process it was handed to); seal with \
                 FUTURE_WRITE to keep such a mapping writable and refuse new writers"
            ),
        ),
        Errno::PERM => Error::wrong_backing(
            op,
            format!("{seals:?}: the memfd is sealed against new seals (F_SEAL_SEAL, EPERM)"),
            "a memfd that takes new seals",
        ),
        e => Error::os("fcntl", e, format_args!("F_ADD_SEALS {seals:?}")),
    })
}

fn memfd_error(op: &'static str, name: &str, e: memfd::Error) -> Error {
    match e {
        memfd::Error::Create(e) | memfd::Error::AddSeals(e) | memfd::Error::GetSeals(e) => {
            Error::io(op, name.to_string(), e)
        }
    }
}

impl Region {
    /// A shared mapping of a new memfd (shmem) of `len` bytes rounded up to pages. Its
    /// shared policy (set by [`Region::bind`]) places its pages, unlike the page cache
    /// of a regular file. The memfd allows sealing.
    ///
    /// # Errors
    /// `len` is 0, or creating, sizing or mapping the memfd fails.
    #[doc(alias = "memfd_create")]
    pub fn memfd(name: &str, len: usize) -> Result<Region> {
        Region::memfd_with(name, len, None)
    }

    /// [`Region::memfd`], optionally backed by hugetlbfs pages of `huge` size (`len` is
    /// rounded up to that size). The pool is checked first: with too few free huge pages
    /// the error says how many are needed and how to reserve them (`vm.nr_hugepages`),
    /// rather than a bare `ENOMEM`. The mapping reserves its pages, so touching it cannot
    /// SIGBUS for want of pages; bind before [`Region::populate_write`], which turns a
    /// bound node without free huge pages into an error too.
    ///
    /// # Errors
    /// `len` is 0 or overflows, [`Error::HugePages`], or `memfd_create`, `ftruncate` or
    /// `mmap` fails.
    ///
    /// # Example
    /// ```
    /// use numapin::{HugePageSize, Region};
    /// match Region::memfd_with("weights", 4 << 20, Some(HugePageSize::Size2M)) {
    ///     Ok(region) => assert_eq!(region.len(), 4 << 20),
    ///     Err(e) => println!("{e}"), // no huge pages reserved here
    /// }
    /// ```
    pub fn memfd_with(name: &str, len: usize, huge: Option<HugePageSize>) -> Result<Region> {
        const OP: &str = "Region::memfd";
        let unit = huge.map_or(page_size(), HugePageSize::bytes);
        let len = round_len(OP, len, unit)?;
        let pool_error = |size: HugePageSize, available: Option<usize>| Error::HugePages {
            page_bytes: size.bytes(),
            wanted: len / size.bytes(),
            available: available.unwrap_or(0),
            offered: available.is_some(),
        };
        if let Some(size) = huge {
            let available = size.available();
            if available.is_none_or(|a| a < len / size.bytes()) {
                return Err(pool_error(size, available));
            }
        }
        let fd = MemfdOptions::default()
            .allow_sealing(true)
            .close_on_exec(true)
            .hugetlb(huge.map(HugePageSize::memfd))
            .create(name)
            .map_err(|e| memfd_error("memfd_create", name, e))?;
        fd.as_file()
            .set_len(len as u64)
            .map_err(|e| Error::io("ftruncate", name, e))?;
        // SAFETY: a new mapping of our own memfd; the fd outlives it (kept in Backing).
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd.as_file().as_fd(),
                0,
            )
        };
        let ptr = match (ptr, huge) {
            // The pool emptied between the check and the reservation.
            (Err(Errno::NOMEM), Some(size)) => return Err(pool_error(size, size.available())),
            (r, _) => r.map_err(|e| {
                Error::os("mmap", e, format_args!("memfd {name:?} len={len} shared"))
            })?,
        };
        Ok(Region::owned(ptr, len, Backing::Memfd(fd)))
    }

    /// Adds seals to a memfd region's file.
    ///
    /// # Errors
    /// The region is not a memfd, or `F_ADD_SEALS` fails (`EBUSY`: [`Seals::WRITE`]
    /// while this region's writable mapping exists, use [`Seals::FUTURE_WRITE`];
    /// `EPERM`: [`Seals::SEAL`] was set before).
    pub fn seal(&self, seals: Seals) -> Result<()> {
        let file = self
            .file()
            .ok_or_else(|| Error::wrong_backing("Region::seal", NOT_MEMFD, "a memfd region"))?;
        add_seals("Region::seal", file, seals)
    }

    /// The seals of a memfd region's file.
    ///
    /// # Errors
    /// The region is not a memfd, or `F_GET_SEALS` fails.
    pub fn seals(&self) -> Result<Seals> {
        let file = self
            .file()
            .ok_or_else(|| Error::wrong_backing("Region::seals", NOT_MEMFD, "a memfd region"))?;
        file_seals("Region::seals", file)
    }

    /// Maps `len` bytes of a memfd another process shared (an inherited or received fd):
    /// the same pages, no copy, placed by the file's shared policy. Safe because the
    /// kernel guarantees the bytes cannot change: the file must carry
    /// [`Seals::IMMUTABLE`] (`F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW`, checked with
    /// `F_GET_SEALS`), and it is mapped private and read-only (`MAP_PRIVATE`, which also
    /// works on kernels before 6.7, where a read-only `MAP_SHARED` mapping of a
    /// write-sealed memfd fails with `EPERM`; `MAP_NORESERVE`, without which a hugetlb
    /// memfd would reserve pages for copies that never happen).
    ///
    /// # Errors
    /// The file is not a memfd, lacks one of the three seals, is shorter than `len`
    /// (touching past its end would SIGBUS), `len` is 0, or `mmap` fails.
    ///
    /// # Example
    /// ```
    /// use numapin::{Region, Seals};
    /// let file = std::fs::File::open("/proc/self/exe").unwrap();
    /// // A plain file can be truncated by anyone who can write it: refused.
    /// assert!(Region::attach_shared(file, 4096).is_err());
    /// ```
    pub fn attach_shared(file: File, len: usize) -> Result<Region> {
        const OP: &str = "Region::attach_shared";
        let seals = file_seals(OP, &file)?;
        if !seals.contains(Seals::IMMUTABLE) {
            return Err(Error::wrong_backing(
                OP,
                format!(
                    "the memfd carries {seals:?}, not WRITE | SHRINK | GROW: another process \
                     could change or truncate it under this mapping"
                ),
                "a memfd sealed WRITE | SHRINK | GROW (PinStore::export seals what it hands out)",
            ));
        }
        let (ptr, map_len) =
            super::map::map_read_only(OP, &file, 0, len, MapFlags::PRIVATE | MapFlags::NORESERVE)?;
        Ok(Region::owned(ptr, map_len, Backing::Sealed(file)))
    }

    /// The sealed memfd behind an attached region, or behind an exported store's frozen
    /// region. Safe to hand out, unlike [`Region::memfd_file`]: the file carries
    /// [`Seals::IMMUTABLE`], so the kernel refuses every write, resize or hole punch.
    pub fn sealed_file(&self) -> Option<&File> {
        match &self.backing {
            Backing::Sealed(file) => Some(file),
            _ => None,
        }
    }

    /// Makes a memfd region immutable in place: re-maps it at the same address, private
    /// and read-only (`MAP_FIXED | MAP_PRIVATE | MAP_NORESERVE`, `PROT_READ`: the same
    /// pages), locks it again if it was locked, then seals the file with
    /// [`Seals::IMMUTABLE`]. A region already sealed only gets its seals checked.
    /// Pages are not populated here: the caller populates what it will serve
    /// ([`Region::populate_read`]).
    ///
    /// If the remap fails, the kernel has already unmapped the range: the region becomes
    /// empty ([`Region::is_empty`]) and forgets the address.
    ///
    /// # Errors
    /// The region is not a memfd, or `mmap`, `mlock` or `F_ADD_SEALS` fail.
    pub(crate) fn freeze_shared(&mut self) -> Result<()> {
        const OP: &str = "PinStore::export";
        match &self.backing {
            Backing::Memfd(_) => {}
            Backing::Sealed(file) => return add_seals(OP, file, Seals::IMMUTABLE),
            _ => return Err(Error::wrong_backing(OP, NOT_MEMFD, "a memfd region")),
        }
        let Backing::Memfd(fd) = std::mem::replace(&mut self.backing, Backing::Lost) else {
            return Err(Error::wrong_backing(OP, NOT_MEMFD, "a memfd region"));
        };
        let file = fd.into_file();
        let len = self.map_len();
        // SAFETY: MAP_FIXED over exactly this region's own mapping, with the file that
        // backs it at the same offset: the same pages, now private and read-only.
        // `&mut self` guarantees no slice of the region is live, and nothing else maps
        // this range.
        let remapped = unsafe {
            rustix::mm::mmap(
                self.as_ptr().cast(),
                len,
                ProtFlags::READ,
                MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
                file.as_fd(),
                0,
            )
        };
        if let Err(e) = remapped {
            let addr = self.as_ptr();
            self.ptr = std::ptr::NonNull::dangling();
            self.len = 0;
            return Err(Error::os(
                "mmap",
                e,
                format_args!(
                    "{OP}: addr={addr:p} len={len} MAP_FIXED|MAP_PRIVATE|MAP_NORESERVE \
                     read-only (the range is no longer mapped)"
                ),
            ));
        }
        self.backing = Backing::Sealed(file);
        if self.locked.load(std::sync::atomic::Ordering::Relaxed) {
            self.mlock(self.map_len() as u64)?;
        }
        let Backing::Sealed(file) = &self.backing else {
            return Ok(());
        };
        add_seals(OP, file, Seals::IMMUTABLE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freezing_remaps_in_place_keeps_bytes_and_lock_and_seals() {
        let len = 4 * page_size();
        let mut region = Region::memfd("numapin-freeze", len).unwrap();
        region.as_mut_slice().unwrap().fill(42);
        region.lock().unwrap();
        let addr = region.as_ptr();
        region.freeze_shared().unwrap();
        assert_eq!(region.as_ptr(), addr, "same address");
        assert_eq!(region.len(), len);
        assert!(region.as_slice().iter().all(|&b| b == 42));
        assert!(region.seals().unwrap().contains(Seals::IMMUTABLE));
        // The new mapping is locked again (mlock faults every page in).
        assert_eq!(region.memory().unwrap().locked, len as u64);
        // Read-only from now on, and freezing again only checks the seals.
        assert!(region.as_mut_slice().is_err());
        assert!(region.release(0..page_size()).is_err());
        region.freeze_shared().unwrap();
        // Anonymous memory cannot be frozen.
        assert!(Region::anonymous(len).unwrap().freeze_shared().is_err());
    }
}
