//! What the kernel says about this process in `/proc`: map counts, `maps`, `numa_maps`,
//! `smaps`, RSS. Pure parsing: no syscalls beyond reading files, no `unsafe` (residency
//! by `mincore` is [`crate::resident_pages`], a range's policy
//! [`crate::Region::policy_at`]).

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::node::{Node, NodeSet};

fn read(path: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))
}

/// Number of mappings (VMAs) this process has: lines of `/proc/self/maps`.
///
/// # Errors
/// `/proc/self/maps` cannot be read.
pub fn map_count() -> Result<usize> {
    Ok(read("/proc/self/maps")?.lines().count())
}

/// Number of mappings that overlap `[start, end)`.
///
/// # Errors
/// `/proc/self/maps` cannot be read.
#[doc(hidden)]
pub fn maps_in_range(start: usize, end: usize) -> Result<usize> {
    maps_overlapping(&[(start, end)])
}

/// Number of mappings that overlap any of the `[start, end)` spans (each mapping counted
/// once), from one read of `/proc/self/maps`.
///
/// # Errors
/// `/proc/self/maps` cannot be read.
#[doc(hidden)]
pub fn maps_overlapping(spans: &[(usize, usize)]) -> Result<usize> {
    let mut sorted = spans.to_vec();
    sorted.sort_unstable();
    // Running maximum of span ends, so one binary search answers "does any span overlap".
    let mut max_end = Vec::with_capacity(sorted.len());
    let mut running = 0;
    for &(_, e) in &sorted {
        running = running.max(e);
        max_end.push(running);
    }
    let overlaps = |a: usize, b: usize| {
        // Spans starting before `b`; the one with the largest end among them decides.
        let n = sorted.partition_point(|&(s, _)| s < b);
        n > 0 && max_end[n - 1] > a
    };
    let maps = read("/proc/self/maps")?;
    Ok(maps
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.split_once('-'))
        .filter_map(|(a, b)| {
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .filter(|&(a, b)| overlaps(a, b))
        .count())
}

/// One line of `/proc/self/maps`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapsEntry {
    /// Start address.
    pub start: usize,
    /// End address (exclusive).
    pub end: usize,
    /// `rwxp` / `rwxs`.
    pub perms: String,
    /// Offset into the file.
    pub offset: u64,
    /// The file's inode (0 for anonymous memory).
    pub inode: u64,
    /// The path, `[heap]`-style name, or `None`; a deleted file ends in ` (deleted)`.
    pub path: Option<String>,
}

impl MapsEntry {
    /// A `MAP_SHARED` mapping (`s` in the permissions).
    pub(crate) fn is_shared(&self) -> bool {
        self.perms.as_bytes().get(3) == Some(&b's')
    }
}

/// Parses `/proc/<pid>/maps` text; lines that do not parse are skipped.
pub(crate) fn parse_maps(text: &str) -> Vec<MapsEntry> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.splitn(6, ' ');
            let (range, perms, offset, _dev, inode) = (
                words.next()?,
                words.next()?,
                words.next()?,
                words.next()?,
                words.next()?,
            );
            let (a, b) = range.split_once('-')?;
            let path = words.next().map(str::trim_start).filter(|p| !p.is_empty());
            Some(MapsEntry {
                start: usize::from_str_radix(a, 16).ok()?,
                end: usize::from_str_radix(b, 16).ok()?,
                perms: perms.to_string(),
                offset: u64::from_str_radix(offset, 16).ok()?,
                inode: inode.parse().ok()?,
                path: path.map(str::to_string),
            })
        })
        .collect()
}

/// The mappings of this process that overlap `[start, end)`.
///
/// # Errors
/// `/proc/self/maps` cannot be read.
pub fn maps_entries_in(start: usize, end: usize) -> Result<Vec<MapsEntry>> {
    use std::io::BufRead;
    const PATH: &str = "/proc/self/maps";
    // Read line by line and stop past `end`: the file is sorted by address, and the
    // kernel writes it as it is read, so a range near the start costs little even in a
    // process with tens of thousands of mappings.
    let file = std::fs::File::open(PATH).map_err(|e| Error::io("open", PATH, e))?;
    let mut found = Vec::new();
    for line in std::io::BufReader::new(file).lines() {
        let line = line.map_err(|e| Error::io("read", PATH, e))?;
        let Some(entry) = parse_maps(&line).pop() else {
            continue;
        };
        if entry.start >= end {
            break;
        }
        if start < entry.end {
            found.push(entry);
        }
    }
    Ok(found)
}

/// The file-backed mappings of this process, as `[start, end)` ranges, from the entries
/// of `/proc/self/map_files` (one per file-backed mapping: anonymous memory, however many
/// mappings it has, costs nothing to list).
///
/// # Errors
/// The directory cannot be read (Linux before 4.3 required `CAP_SYS_ADMIN`).
pub(crate) fn file_backed_ranges() -> Result<Vec<(usize, usize)>> {
    const PATH: &str = "/proc/self/map_files";
    let dir = std::fs::read_dir(PATH).map_err(|e| Error::io("read_dir", PATH, e))?;
    let mut ranges = Vec::new();
    for entry in dir {
        let entry = entry.map_err(|e| Error::io("read_dir", PATH, e))?;
        let name = entry.file_name();
        let parsed = name
            .to_str()
            .and_then(|n| n.split_once('-'))
            .and_then(|(a, b)| {
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            });
        if let Some(range) = parsed {
            ranges.push(range);
        }
    }
    Ok(ranges)
}

/// `vm.max_map_count`: how many mappings a process may have.
///
/// # Errors
/// The sysctl cannot be read or parsed.
pub fn max_map_count() -> Result<usize> {
    let path = "/proc/sys/vm/max_map_count";
    let text = read(path)?;
    text.trim().parse().map_err(|_| Error::Unparsable {
        path: path.into(),
        what: "a map count",
        found: text.chars().take(64).collect(),
    })
}

/// Address space a new thread may take at most: its stack (Rust's default 2 MiB, up to
/// 8 MiB where `RUST_MIN_STACK` or a builder asks), its signal stack, and the malloc
/// arena glibc may make for it at its first allocation, which maps 128 MiB (twice its
/// 64 MiB heap, to align it) before it trims the excess.
pub(crate) const THREAD_ADDRESS_SPACE: u64 = 136 << 20;

/// How many more threads fit under the process's `RLIMIT_AS` (its soft limit less
/// `VmSize`, [`THREAD_ADDRESS_SPACE`] each), or `usize::MAX` where the limit is infinite or
/// the figures cannot be read. A thread that gets its stack but not its signal stack
/// aborts the process inside Rust's runtime (nothing can catch it), so the loaders and
/// read threads are not spawned where the address space has no room for them: the
/// calling thread does their work.
pub(crate) fn threads_in_address_space() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::As).current;
    let Some(limit) = limit else {
        return usize::MAX;
    };
    let Ok(Some(size_kib)) = status_kib("VmSize") else {
        return usize::MAX;
    };
    let room = limit.saturating_sub(size_kib.saturating_mul(1024));
    usize::try_from(room / THREAD_ADDRESS_SPACE).unwrap_or(usize::MAX)
}

/// A `kB` field of `/proc/self/status` (`VmLck`, `VmRSS`, ...), in KiB.
///
/// # Errors
/// `/proc/self/status` cannot be read.
pub(crate) fn status_kib(field: &str) -> Result<Option<u64>> {
    Ok(kib_field(&read("/proc/self/status")?, field))
}

fn kib_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// Resident bytes of this process: the kernel's RSS counter (`VmRSS` of
/// `/proc/self/status`, what `ps` and `top` show).
///
/// Not `smaps_rollup`'s `Rss`: that walks the page tables, and on Linux 6.1 with THP
/// `always` it was seen to miss a third of a 360 MB process while khugepaged ran
/// (235 MB against a VmRSS of 362 MB); the counter does not race that walk. Use
/// [`process_memory`] for the breakdown by kind.
///
/// # Errors
/// `/proc/self/status` cannot be read or has no `VmRSS` line.
pub fn rss_bytes() -> Result<u64> {
    status_kib("VmRSS")?
        .map(|k| k * 1024)
        .ok_or_else(|| Error::Unparsable {
            path: "/proc/self/status".to_string(),
            what: "VmRSS (the line is missing)",
            found: String::new(),
        })
}

/// The memory figures of one mapping in `/proc/self/smaps`, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SmapsEntry {
    /// Start address.
    pub start: usize,
    /// End address (exclusive).
    pub end: usize,
    /// `Rss`.
    pub rss: u64,
    /// `Anonymous`.
    pub anonymous: u64,
    /// `AnonHugePages`.
    pub anon_huge: u64,
    /// `Shared_Clean + Shared_Dirty`.
    pub shared: u64,
    /// `Private_Clean + Private_Dirty`.
    pub private: u64,
    /// `Locked`: the kernel counts it proportionally (PSS), so a page shared with a
    /// forked child counts half until the child execs or exits.
    pub locked: u64,
    /// `ShmemPmdMapped`: shmem/memfd mapped with huge pages.
    pub shmem_huge: u64,
    /// `Shared_Hugetlb + Private_Hugetlb` (not part of `Rss`).
    pub hugetlb: u64,
    /// `Swap`.
    pub swap: u64,
}

impl SmapsEntry {
    /// Resident bytes not anonymous: page cache of files, and shmem/memfd.
    pub fn file_backed(&self) -> u64 {
        self.rss.saturating_sub(self.anonymous)
    }

    /// Huge-page bytes of every kind (THP anonymous and shmem, hugetlbfs).
    pub fn huge(&self) -> u64 {
        self.anon_huge + self.shmem_huge + self.hugetlb
    }

    fn add(&mut self, other: &SmapsEntry) {
        self.rss += other.rss;
        self.anonymous += other.anonymous;
        self.anon_huge += other.anon_huge;
        self.shared += other.shared;
        self.private += other.private;
        self.locked += other.locked;
        self.shmem_huge += other.shmem_huge;
        self.hugetlb += other.hugetlb;
        self.swap += other.swap;
    }

    /// The sum of several entries (their span from the first start to the last end).
    pub(crate) fn total(entries: &[SmapsEntry]) -> SmapsEntry {
        let mut sum = SmapsEntry {
            start: entries.first().map_or(0, |e| e.start),
            end: entries.last().map_or(0, |e| e.end),
            ..SmapsEntry::default()
        };
        entries.iter().for_each(|e| sum.add(e));
        sum
    }
}

/// This process's memory, by kind (`/proc/self/smaps_rollup`): why RSS is what it is,
/// e.g. a model that is mostly page cache (file-backed) or a doubled private copy.
///
/// # Errors
/// `smaps_rollup` cannot be read.
pub fn process_memory() -> Result<SmapsEntry> {
    let text = read("/proc/self/smaps_rollup")?;
    // The rollup has one header line (the address span), then the same fields as smaps.
    Ok(parse_smaps(&text).into_iter().next().unwrap_or_default())
}

/// The `smaps` entries of the mappings that overlap `[start, end)`.
///
/// # Errors
/// `/proc/self/smaps` cannot be read.
pub fn smaps_in_range(start: usize, end: usize) -> Result<Vec<SmapsEntry>> {
    smaps_overlapping(&[(start, end)])
}

/// The `smaps` entries of the mappings that overlap any of the spans, each once.
///
/// # Errors
/// `/proc/self/smaps` cannot be read.
#[doc(hidden)]
pub fn smaps_overlapping(spans: &[(usize, usize)]) -> Result<Vec<SmapsEntry>> {
    Ok(parse_smaps(&read("/proc/self/smaps")?)
        .into_iter()
        .filter(|e| spans.iter().any(|&(s, end)| e.start < end && s < e.end))
        .collect())
}

fn parse_smaps(text: &str) -> Vec<SmapsEntry> {
    let mut out: Vec<SmapsEntry> = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            out.push(SmapsEntry {
                start: a,
                end: b,
                ..SmapsEntry::default()
            });
            continue;
        }
        let (Some(entry), Some(key)) = (out.last_mut(), first.strip_suffix(':')) else {
            continue;
        };
        let bytes = words
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024;
        match key {
            "Rss" => entry.rss = bytes,
            "Anonymous" => entry.anonymous = bytes,
            "AnonHugePages" => entry.anon_huge = bytes,
            "Shared_Clean" | "Shared_Dirty" => entry.shared += bytes,
            "Private_Clean" | "Private_Dirty" => entry.private += bytes,
            "Locked" => entry.locked = bytes,
            "ShmemPmdMapped" => entry.shmem_huge = bytes,
            "Shared_Hugetlb" | "Private_Hugetlb" => entry.hugetlb += bytes,
            "Swap" => entry.swap = bytes,
            _ => {}
        }
    }
    out
}

/// One line of `/proc/<pid>/numa_maps`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NumaMapsEntry {
    /// Start address of the mapping.
    pub address: usize,
    /// The policy as the kernel prints it: `default`, `bind:0-1`, `prefer (many):0-1`,
    /// `interleave=static:0-2`, `weighted interleave:0-2`.
    pub policy: String,
    /// Pages per node (`N0=12`), in pages of `kernel_page_kib`.
    pub pages: BTreeMap<Node, u64>,
    /// `anon=` pages.
    pub anon: u64,
    /// `dirty=` pages.
    pub dirty: u64,
    /// `mapped=` pages (file-backed pages mapped).
    pub mapped: u64,
    /// The `file=` path, if any.
    pub file: Option<String>,
    /// Whether the mapping is hugetlb (`huge`).
    pub huge: bool,
    /// `kernelpagesize_kB=`.
    pub kernel_page_kib: u64,
}

impl NumaMapsEntry {
    /// The policy name without flags or nodes (`bind`, `prefer (many)`).
    pub fn policy_mode(&self) -> &str {
        let head = self.policy.split(':').next().unwrap_or("");
        head.split('=').next().unwrap_or(head)
    }

    /// The mode flags suffix, if any (`static`, `relative`, `balancing`).
    pub fn policy_flags(&self) -> Option<&str> {
        let head = self.policy.split(':').next()?;
        head.split_once('=').map(|(_, f)| f)
    }

    /// The policy's node list, if it has one.
    pub fn policy_nodes(&self) -> Option<NodeSet> {
        crate::node::parse_kernel_list(self.policy.split_once(':')?.1)
    }
}

/// Parses `numa_maps` text.
pub(crate) fn parse_numa_maps(text: &str) -> Vec<NumaMapsEntry> {
    text.lines().filter_map(parse_numa_maps_line).collect()
}

fn parse_numa_maps_line(line: &str) -> Option<NumaMapsEntry> {
    let (addr, rest) = line.split_once(' ')?;
    let address = usize::from_str_radix(addr, 16).ok()?;
    // Two policy names contain a space; every other name is one word.
    let (policy, rest) = ["prefer (many)", "weighted interleave"]
        .iter()
        .find_map(|name| {
            let tail = rest.strip_prefix(name)?;
            let end = tail.find(' ').unwrap_or(tail.len());
            Some((&rest[..name.len() + end], &tail[end..]))
        })
        .unwrap_or_else(|| rest.split_once(' ').unwrap_or((rest, "")));
    let mut entry = NumaMapsEntry {
        address,
        policy: policy.to_string(),
        ..NumaMapsEntry::default()
    };
    let mut in_file = false;
    for word in rest.split_whitespace() {
        let (key, value) = word.split_once('=').unwrap_or((word, ""));
        let number = value.parse::<u64>().ok();
        match (key, number) {
            ("file", _) => {
                entry.file = Some(value.to_string());
                in_file = true;
                continue;
            }
            ("anon", Some(n)) => entry.anon = n,
            ("dirty", Some(n)) => entry.dirty = n,
            ("mapped", Some(n)) => entry.mapped = n,
            ("kernelpagesize_kB", Some(n)) => entry.kernel_page_kib = n,
            ("huge", _) => entry.huge = true,
            (k, Some(n)) if k.len() > 1 && k.starts_with('N') && k[1..].parse::<u16>().is_ok() => {
                let node = Node(k[1..].parse().ok()?);
                entry.pages.insert(node, n);
            }
            (
                "heap" | "stack" | "mapmax" | "swapcache" | "active" | "writeback" | "unevictable",
                _,
            ) => {}
            _ if in_file => {
                // A path with spaces: the words belong to `file=`.
                if let Some(f) = entry.file.as_mut() {
                    f.push(' ');
                    f.push_str(word);
                }
                continue;
            }
            _ => {}
        }
        in_file = false;
    }
    Some(entry)
}

/// This process's `numa_maps`.
///
/// # Errors
/// `/proc/self/numa_maps` cannot be read (kernels without NUMA have no such file).
pub(crate) fn numa_maps() -> Result<Vec<NumaMapsEntry>> {
    Ok(parse_numa_maps(&read("/proc/self/numa_maps")?))
}

/// The `numa_maps` entry of the mapping that starts at `addr`.
///
/// # Errors
/// `/proc/self/numa_maps` cannot be read.
pub fn numa_maps_at(addr: *const u8) -> Result<Option<NumaMapsEntry>> {
    Ok(numa_maps()?
        .into_iter()
        .find(|e| e.address == addr as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_maps_lines_parse() {
        let text = "\
7f0000000000 interleave:0-2 anon=3 dirty=3 N0=1 N1=1 N2=1 kernelpagesize_kB=4
7f0000200000 prefer (many):0-1 anon=2 dirty=2 N1=2 kernelpagesize_kB=4
7f0000400000 bind=static:1 file=/tmp/a b.bin mapped=4 N1=4 kernelpagesize_kB=4
7f0000600000 weighted interleave=relative:0,2 huge anon=1 N2=1 kernelpagesize_kB=2048
7f0000800000 default stack anon=1 dirty=1 active=0 N0=1 kernelpagesize_kB=4
";
        let e = parse_numa_maps(text);
        assert_eq!(e.len(), 5);
        assert_eq!(e[0].address, 0x7f0000000000);
        assert_eq!(e[0].policy_mode(), "interleave");
        assert_eq!(e[0].pages.values().sum::<u64>(), 3);
        assert_eq!(e[0].policy_nodes(), NodeSet::from_nodes([0, 1, 2]).ok());
        assert_eq!(e[1].policy, "prefer (many):0-1");
        assert_eq!(e[1].policy_mode(), "prefer (many)");
        assert_eq!(e[1].pages.get(&Node(1)), Some(&2));
        assert_eq!(e[2].policy_mode(), "bind");
        assert_eq!(e[2].policy_flags(), Some("static"));
        assert_eq!(e[2].file.as_deref(), Some("/tmp/a b.bin"));
        assert_eq!(e[2].mapped, 4);
        assert_eq!(e[3].policy_mode(), "weighted interleave");
        assert_eq!(e[3].policy_flags(), Some("relative"));
        assert!(e[3].huge);
        assert_eq!(e[3].kernel_page_kib, 2048);
        assert_eq!(e[4].policy, "default");
        assert_eq!((e[4].anon, e[4].dirty), (1, 1));
    }

    #[test]
    fn maps_lines_parse() {
        let text = "\
7f0000000000-7f0000200000 rw-p 00000000 00:00 0 
7f0000200000-7f0000201000 r--s 00001000 fd:01 1234                       /data/model file.bin
7f0000201000-7f0000202000 rw-s 00000000 00:05 7                          /memfd:x (deleted)
garbage
";
        let e = parse_maps(text);
        assert_eq!(e.len(), 3);
        assert_eq!(
            (e[0].start, e[0].end, e[0].inode),
            (0x7f0000000000, 0x7f0000200000, 0)
        );
        assert!(!e[0].is_shared() && e[0].path.is_none());
        assert!(e[1].is_shared());
        assert_eq!(e[1].offset, 0x1000);
        assert_eq!(e[1].path.as_deref(), Some("/data/model file.bin"));
        assert_eq!(e[2].path.as_deref(), Some("/memfd:x (deleted)"));
    }

    #[test]
    fn smaps_entries_parse() {
        let text = "\
7f0000000000-7f0000200000 rw-p 00000000 00:00 0 
Size:               2048 kB
Rss:                 512 kB
Shared_Clean:          0 kB
Private_Dirty:       512 kB
Anonymous:           512 kB
AnonHugePages:         0 kB
Locked:                0 kB
7f0000200000-7f0000201000 r--s 00000000 00:05 7   /memfd:x (deleted)
Rss:                   4 kB
Shared_Dirty:          4 kB
";
        let e = parse_smaps(text);
        assert_eq!(e.len(), 2);
        assert_eq!(
            (e[0].rss, e[0].private, e[0].anonymous),
            (512 << 10, 512 << 10, 512 << 10)
        );
        assert_eq!((e[1].start, e[1].shared), (0x7f0000200000, 4096));
    }

    #[test]
    fn live_figures_are_plausible() {
        let maps = map_count().unwrap();
        assert!(maps > 0 && maps < max_map_count().unwrap());
        assert!(rss_bytes().unwrap() > 0);
    }
}
