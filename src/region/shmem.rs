//! memfd (shmem) regions: placed by their shared policy, sealable, shareable.

use std::fs::File;
use std::os::fd::AsFd;

use memfd::{FileSeal, HugetlbSize, MemfdOptions};
use rustix::mm::{MapFlags, ProtFlags};

use super::{Backing, Region, round_len};
use crate::error::{Errno, Error, Result};
use crate::page_size;

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
    fn file_seals(self) -> Vec<FileSeal> {
        [
            (Seals::SHRINK, FileSeal::SealShrink),
            (Seals::GROW, FileSeal::SealGrow),
            (Seals::WRITE, FileSeal::SealWrite),
            (Seals::FUTURE_WRITE, FileSeal::SealFutureWrite),
            (Seals::SEAL, FileSeal::SealSeal),
        ]
        .into_iter()
        .filter(|(flag, _)| self.contains(*flag))
        .map(|(_, seal)| seal)
        .collect()
    }
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
        let Backing::Memfd(fd) = &self.backing else {
            return Err(Error::invalid(
                "Region::seal",
                "only memfd regions can be sealed",
            ));
        };
        fd.add_seals(&seals.file_seals()).map_err(|e| match e {
            memfd::Error::AddSeals(io) if io.raw_os_error() == Some(libc::EBUSY) => Error::invalid(
                "Region::seal",
                format!(
                    "{seals:?}: F_SEAL_WRITE is refused (EBUSY) while a writable mapping exists; \
                     seal with FUTURE_WRITE to keep this mapping writable and refuse new writers"
                ),
            ),
            other => memfd_error("fcntl(F_ADD_SEALS)", "memfd", other),
        })
    }

    /// The seals of a memfd region's file.
    ///
    /// # Errors
    /// The region is not a memfd, or `F_GET_SEALS` fails.
    pub fn seals(&self) -> Result<Seals> {
        let Backing::Memfd(fd) = &self.backing else {
            return Err(Error::invalid(
                "Region::seals",
                "only memfd regions have seals",
            ));
        };
        let set = fd
            .seals()
            .map_err(|e| memfd_error("fcntl(F_GET_SEALS)", "memfd", e))?;
        Ok([
            (FileSeal::SealShrink, Seals::SHRINK),
            (FileSeal::SealGrow, Seals::GROW),
            (FileSeal::SealWrite, Seals::WRITE),
            (FileSeal::SealFutureWrite, Seals::FUTURE_WRITE),
            (FileSeal::SealSeal, Seals::SEAL),
        ]
        .into_iter()
        .filter(|(seal, _)| set.contains(seal))
        .fold(Seals::empty(), |acc, (_, flag)| acc | flag))
    }

    /// Maps `len` bytes of a memfd another process shared (an inherited or received fd),
    /// read-only and shared: the same pages, no copy, placed by the file's shared policy.
    ///
    /// # Errors
    /// `len` is 0 or longer than the file (touching past its end would SIGBUS), or `mmap`
    /// fails.
    pub fn attach_shared(file: File, len: usize) -> Result<Region> {
        let (ptr, map_len) = super::map_read_only("Region::attach_shared", &file, 0, len)?;
        Ok(Region::owned(ptr, map_len, Backing::Attached(file)))
    }
}
