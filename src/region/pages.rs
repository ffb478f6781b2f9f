//! Where a range's pages are: `move_pages` queries, or `/proc/self/numa_maps` where the
//! page calls are denied (Docker with `--cap-add SYS_NICE`).

use std::collections::BTreeMap;
use std::ffi::c_void;

use numapin_sys as sys;

use crate::calls::degrade_or_error;
use crate::calls::{MempolicySupport, NumaCall};
use crate::diag;
use crate::error::{Errno, Error, Result};
use crate::page::page_size;
use crate::policy::{DegradeReason, Observed};

/// Where the counts of a [`NodeHistogram`] come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum PagesSource {
    /// `move_pages` with no target nodes: the node of each page, asked page by page.
    #[default]
    MovePages,
    /// `/proc/self/numa_maps` (`N<node>=<pages>` per mapping), where the page calls are
    /// denied (Docker's default profile allows no `move_pages`, even with
    /// `--cap-add SYS_NICE`). It counts only the pages this process has mapped in its
    /// page tables: pages of a memfd that another process (or a `read`) brought in but
    /// this mapping never touched count as not present. A mapping the kernel merged with
    /// a neighbour outside the range is counted in [`NodeHistogram::merged`], never
    /// guessed.
    NumaMaps,
}

impl PagesSource {
    /// `move_pages` or `numa_maps`.
    pub fn name(self) -> &'static str {
        match self {
            PagesSource::MovePages => "move_pages",
            PagesSource::NumaMaps => "numa_maps",
        }
    }
}

impl std::fmt::Display for PagesSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Pages of a range per node, as the kernel reports them (`move_pages` with no target
/// nodes, or `numa_maps`: nothing is moved or faulted in).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeHistogram {
    /// Present pages per node.
    pub pages: BTreeMap<crate::node::Node, usize>,
    /// Pages never touched or released (`-ENOENT`; `-EFAULT` for a page without a page
    /// table or backed by the shared zero page, as older kernels report them; from
    /// `numa_maps`: the range's pages not counted on any node).
    pub not_present: usize,
    /// Pages the kernel reported another error for.
    pub other: usize,
    /// Pages whose node is unknown: they lie in a mapping that reaches past the range
    /// (the kernel merged it with an equal neighbour) and has pages, and `numa_maps`
    /// counts per mapping. Always 0 from `move_pages`.
    pub merged: usize,
    /// Where the counts come from.
    pub source: PagesSource,
}

impl NodeHistogram {
    /// Present pages in all.
    pub fn present(&self) -> usize {
        self.pages.values().sum()
    }

    /// Present pages on `node`.
    pub fn on(&self, node: crate::node::Node) -> usize {
        self.pages.get(&node).copied().unwrap_or(0)
    }
}

/// Histogram of the pages of `[start, start + len)` by node, via `move_pages` with no
/// target nodes, in chunks so memory stays bounded.
///
/// # Safety
/// The range must be mapped by the caller (pages outside it would be reported as
/// `-EFAULT`, which is harmless, but the addresses must be the caller's to ask about).
pub(crate) unsafe fn page_histogram(start: *mut u8, len: usize) -> Result<Observed<NodeHistogram>> {
    // SAFETY: forwarded from the caller.
    unsafe { page_histogram_sampled(start, len, 1) }
}

/// [`page_histogram`] of every `step`-th page only: bounded cost for huge ranges. The
/// counts are of sampled pages. Step 0 is taken as 1; a step larger than the range
/// samples its first page only.
///
/// # Safety
/// As [`page_histogram`].
pub(crate) unsafe fn page_histogram_sampled(
    start: *mut u8,
    len: usize,
    step: usize,
) -> Result<Observed<NodeHistogram>> {
    let mut histogram = NodeHistogram::default();
    // SAFETY: forwarded from the caller; a query moves nothing.
    let outcome = unsafe {
        for_each_page_status(start, len, step, None, |s| match s {
            s if s >= 0 => {
                *histogram
                    .pages
                    .entry(crate::node::Node(s as u16))
                    .or_default() += 1
            }
            s if is_not_present(s) => histogram.not_present += 1,
            _ => histogram.other += 1,
        })?
    };
    Ok(match outcome {
        Some(reason) => Observed::Degraded(reason),
        None => Observed::Known(histogram),
    })
}

/// Pages per node of the spans `[start, end)` (page-aligned, the caller's own
/// mappings): from `move_pages` of every `step`-th page where the page calls work
/// (counts of sampled pages, summed over the spans), from one read of `numa_maps` where
/// they are denied (exact counts; `step` does not apply), `Degraded(Unsupported)` on a
/// kernel without NUMA.
///
/// # Safety
/// As [`page_histogram`], for each span.
pub(crate) unsafe fn spans_histogram(
    spans: &[(usize, usize)],
    step: usize,
) -> Result<Observed<NodeHistogram>> {
    match NumaCall::MovePages.support()? {
        MempolicySupport::Available => {
            let mut total = NodeHistogram::default();
            for &(start, end) in spans {
                // SAFETY: forwarded from the caller.
                match unsafe { page_histogram_sampled(start as *mut u8, end - start, step)? } {
                    Observed::Known(h) => {
                        for (node, n) in h.pages {
                            *total.pages.entry(node).or_default() += n;
                        }
                        total.not_present += h.not_present;
                        total.other += h.other;
                    }
                    degraded @ Observed::Degraded(_) => return Ok(degraded),
                }
            }
            Ok(Observed::Known(total))
        }
        MempolicySupport::Denied => numa_maps_histogram(spans).map(Observed::Known),
        MempolicySupport::Unsupported => Ok(Observed::Degraded(DegradeReason::Unsupported)),
    }
}

/// Pages per node of the spans from `/proc/self/numa_maps`, whose extents come from
/// `/proc/self/maps`. A mapping lying inside the spans' union counts whole; one that
/// reaches past it counts its share as [`NodeHistogram::merged`] (unless it has no
/// pages at all, when its share is exactly "not present").
///
/// # Errors
/// The files cannot be read, or the mappings touching the spans changed between the two
/// reads every time (a neighbour being mapped and merged), eight times running.
pub(crate) fn numa_maps_histogram(spans: &[(usize, usize)]) -> Result<NodeHistogram> {
    const ATTEMPTS: usize = 8;
    let page = page_size();
    let mut union: Vec<(usize, usize)> = spans.iter().copied().filter(|(a, b)| a < b).collect();
    union.sort_unstable();
    let mut merged_spans: Vec<(usize, usize)> = Vec::with_capacity(union.len());
    for (a, b) in union {
        match merged_spans.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged_spans.push((a, b)),
        }
    }
    let union = merged_spans;
    let total: usize = union.iter().map(|(a, b)| (b - a).div_ceil(page)).sum();
    // Bytes of `[a, b)` inside the union.
    let inside = |a: usize, b: usize| -> usize {
        let first = union.partition_point(|&(_, e)| e <= a);
        union[first..]
            .iter()
            .take_while(|&&(s, _)| s < b)
            .map(|&(s, e)| e.min(b) - s.max(a))
            .sum()
    };
    for _attempt in 0..ATTEMPTS {
        let maps = std::fs::read_to_string("/proc/self/maps")
            .map_err(|e| Error::io("read", "/proc/self/maps", e))?;
        let ends: BTreeMap<usize, usize> = maps
            .lines()
            .filter_map(|l| l.split_whitespace().next()?.split_once('-'))
            .filter_map(|(a, b)| {
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            })
            .collect();
        let entries = diag::numa_maps()?;
        let mut histogram = NodeHistogram {
            source: PagesSource::NumaMaps,
            ..NodeHistogram::default()
        };
        let mut changed = false;
        for (i, entry) in entries.iter().enumerate() {
            // Lines come in address order: the next one bounds this mapping's end, so
            // only mappings that may touch the spans need their extent from `maps`
            // (mappings elsewhere come and go between the reads as other threads work).
            let bound = entries.get(i + 1).map_or(usize::MAX, |next| next.address);
            if inside(entry.address, bound) == 0 {
                continue;
            }
            let Some(&end) = ends.get(&entry.address) else {
                changed = true;
                break;
            };
            let share = inside(entry.address, end);
            if share == 0 {
                continue;
            }
            let scale = (entry.kernel_page_kib as usize * 1024 / page).max(1);
            let present: usize = entry.pages.values().map(|&n| n as usize * scale).sum();
            if present == 0 {
                continue;
            }
            if share == end - entry.address {
                for (&node, &n) in &entry.pages {
                    *histogram.pages.entry(node).or_default() += n as usize * scale;
                }
            } else {
                histogram.merged += share / page;
            }
        }
        if changed {
            continue;
        }
        histogram.not_present = total.saturating_sub(histogram.present() + histogram.merged);
        return Ok(histogram);
    }
    Err(Error::invalid(
        "numa_maps",
        format!(
            "the mappings at the range changed between reading /proc/self/maps and \
             /proc/self/numa_maps, {ATTEMPTS} times running"
        ),
    ))
}

/// ENOENT: no page. EFAULT inside our own mapping: no page table yet, or the shared zero
/// page (kernels before 6.x report untouched pages this way).
fn is_not_present(status: i32) -> bool {
    status == -libc::ENOENT || status == -libc::EFAULT
}

/// Calls `move_pages` over every `step`-th page of `[start, start + len)` in bounded
/// chunks, querying (`target` None) or moving to `target`, and hands each page's status
/// to `per_page`. `Some(reason)` when the call is denied or unsupported here.
///
/// # Safety
/// The range must be the caller's own mapping; with a target, its pages move (contents
/// preserved).
unsafe fn for_each_page_status(
    start: *mut u8,
    len: usize,
    step: usize,
    target: Option<crate::node::Node>,
    mut per_page: impl FnMut(i32),
) -> Result<Option<DegradeReason>> {
    const CHUNK: usize = 1024;
    // Saturating: a step whose stride passes the end of the address space samples the
    // first page only (and a wrapped stride of 0 would divide by zero). Step 0 is 1.
    let page = page_size().saturating_mul(step.max(1));
    let total = len.div_ceil(page);
    let mut pages: Vec<*mut c_void> = Vec::with_capacity(CHUNK.min(total));
    let targets = target.map(|node| vec![i32::from(node.0); CHUNK.min(total)]);
    let mut status = vec![0i32; CHUNK.min(total)];
    let (nodes, flags) = match &targets {
        Some(t) => (t.as_ptr(), sys::MOVE_PAGES_MOVE),
        None => (std::ptr::null(), 0),
    };
    let mut done = 0;
    while done < total {
        let n = CHUNK.min(total - done);
        pages.clear();
        pages.extend((done..done + n).map(|i| start.wrapping_add(i * page).cast::<c_void>()));
        // SAFETY: `pages`, `status` and a non-null `nodes` hold at least `n` elements; the
        // caller owns the pages.
        let result = unsafe {
            sys::move_pages(
                0,
                n as u64,
                pages.as_ptr(),
                nodes,
                status.as_mut_ptr(),
                flags,
            )
        };
        if let Err(errno) = result {
            return degrade_or_error(NumaCall::MovePages, errno, || {
                format!(
                    "pid=0 count={n} first={:p} target={target:?} flags={flags}",
                    pages[0]
                )
            })
            .map(Some);
        }
        status[..n].iter().for_each(|&s| per_page(s));
        done += n;
    }
    Ok(None)
}

/// Resident pages of `[start, start + len)` of this process (`mincore(2)`): exact per
/// range, where `smaps` only knows whole mappings (which merge with equal neighbours).
///
/// Asks the kernel in windows of at most 4096 pages into one fixed 4 KiB buffer, so any
/// length costs bounded memory.
///
/// # Errors
/// `start + len` overflows the address space (`EINVAL`, checked before any call);
/// `start` is not page-aligned (`EINVAL`) or part of the range is unmapped (`ENOMEM`);
/// the error names the whole range and the window that failed.
pub fn resident_pages(start: usize, len: usize) -> Result<usize> {
    let page = crate::page::page_size();
    let end = start
        .checked_add(len)
        .and_then(|end| end.checked_next_multiple_of(page));
    let Some(end) = end else {
        return Err(Error::os(
            "mincore",
            Errno::INVAL,
            format_args!(
                "addr={start:#x} len={len}: the range passes the end of the address space"
            ),
        ));
    };
    let mut vec = [0u8; RESIDENCY_WINDOW];
    let mut resident = 0;
    let mut addr = start;
    // `addr` stays a multiple of the page after the first window when `start` is; an
    // unaligned `start` fails in the first call.
    while addr < end {
        let window = (end - addr).min(RESIDENCY_WINDOW * page);
        let pages = window.div_ceil(page);
        // SAFETY: mincore only reads the page tables of the range (the kernel validates
        // it) and writes one byte per page of `window` into `vec`, which holds
        // RESIDENCY_WINDOW ≥ `pages` bytes.
        let asked = unsafe { sys::mincore(addr as *mut c_void, window, vec.as_mut_ptr()) };
        if let Err(errno) = asked {
            return Err(Error::os(
                "mincore",
                errno,
                format_args!("addr={start:#x} len={len} (window addr={addr:#x} len={window})"),
            ));
        }
        resident += vec[..pages].iter().filter(|&&b| b & 1 != 0).count();
        addr += window;
    }
    Ok(resident)
}

/// Pages [`resident_pages`] asks `mincore` about per call (its buffer's size in bytes).
const RESIDENCY_WINDOW: usize = 4096;

/// What a migration did, counted from the kernel's own per-page answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MoveReport {
    /// Pages that reached the target during this call.
    pub moved: usize,
    /// Present pages on the target afterwards (moved or there already).
    pub on_target: usize,
    /// Present pages still elsewhere afterwards.
    pub left_behind: usize,
    /// Pages not present (never touched or released): nothing to move.
    pub not_present: usize,
    /// Pages `move_pages` refused, by errno (`EBUSY`: page busy or pinned; `EACCES`:
    /// shared with other processes, needs `MOVE_ALL`; `ENOMEM`: target full; ...).
    /// `Region::migrate` (mbind) gives no reasons: its refusals are `left_behind`.
    pub refused: Vec<(Errno, usize)>,
    /// Pages whose node `numa_maps` could not tell, before or after (the region shared a
    /// mapping with a neighbour: see [`NodeHistogram::merged`]); with any, `moved` is a
    /// lower bound. Always 0 from `move_pages`.
    pub merged: usize,
    /// Where the counts come from.
    pub source: PagesSource,
}

impl MoveReport {
    fn refuse(&mut self, errno: Errno) {
        match self.refused.iter_mut().find(|(e, _)| *e == errno) {
            Some((_, n)) => *n += 1,
            None => self.refused.push((errno, 1)),
        }
    }
}

/// Moves every present page of `[start, start + len)` to `node` with `move_pages`.
///
/// # Safety
/// The range must be the caller's own mapping; pages move (contents preserved).
pub(crate) unsafe fn move_range_to(
    start: *mut u8,
    len: usize,
    node: crate::node::Node,
) -> Result<Observed<MoveReport>> {
    // Before anything is asked: a target the kernel would refuse (`ENODEV`, `EACCES`) is
    // an error here too where the call is denied or unsupported.
    crate::policy::check_move_target("move_pages", node)?;
    // SAFETY: forwarded from the caller.
    let before = match unsafe { page_histogram(start, len)? } {
        Observed::Known(h) => h.on(node),
        Observed::Degraded(reason) => return Ok(Observed::Degraded(reason)),
    };
    let mut report = MoveReport::default();
    // SAFETY: forwarded from the caller.
    let outcome = unsafe {
        for_each_page_status(start, len, 1, Some(node), |s| match s {
            s if s == i32::from(node.0) => report.on_target += 1,
            s if s >= 0 => report.left_behind += 1,
            s if is_not_present(s) => report.not_present += 1,
            s => report.refuse(Errno::from_raw_os_error(-s)),
        })?
    };
    if let Some(reason) = outcome {
        return Ok(Observed::Degraded(reason));
    }
    report.moved = report.on_target.saturating_sub(before);
    Ok(Observed::Known(report))
}

/// Counts a range against a target set after an `mbind(MOVE)`, from histograms of
/// either source.
pub(crate) fn report_against(
    before: &NodeHistogram,
    after: &NodeHistogram,
    to: &crate::node::NodeSet,
) -> MoveReport {
    let on = |h: &NodeHistogram| {
        h.pages
            .iter()
            .filter(|(n, _)| to.contains(**n))
            .map(|(_, p)| p)
            .sum::<usize>()
    };
    MoveReport {
        // Pages of `before` whose node is unknown may have been on the target already.
        moved: on(after).saturating_sub(on(before) + before.merged),
        on_target: on(after),
        left_behind: after.present() - on(after),
        not_present: after.not_present,
        refused: Vec::new(),
        merged: before.merged.max(after.merged),
        source: after.source,
    }
}

/// Moves all pages of process `pid` (0: this one) from the nodes `from` to the nodes
/// `to` (`migrate_pages(2)`). Returns the pages that could not be moved.
///
/// Moving another process's pages needs `CAP_SYS_NICE` unless its user ids match ours;
/// that is checked first and named in the error. So do target nodes outside the
/// process's cpuset (the kernel's check, answered with `EPERM`), when some of them are
/// nodes this process may allocate on (the kernel keeps only those).
///
/// # Errors
/// Empty node sets; a node id this machine cannot have (an error naming it and the
/// machine's nodes); a target set with no node this process may allocate on
/// ([`Error::NodeNotAllowed`]) — both checked before the call, in every environment;
/// [`Error::MissingCapability`], no such process (`ESRCH`), or any errno
/// but `EPERM`/`ENOSYS` where the probe found `migrate_pages` denied or unsupported
/// (those give [`Observed::Degraded`]: Docker's default profile denies it even with
/// `--cap-add SYS_NICE`).
#[doc(alias = "migrate_pages")]
pub fn migrate_process(
    pid: i32,
    from: &crate::node::NodeSet,
    to: &crate::node::NodeSet,
) -> Result<Observed<usize>> {
    const OP: &str = "migrate_pages";
    if from.is_empty() || to.is_empty() {
        return Err(Error::empty(
            OP,
            format!("nodes in from {{{from}}} or in to {{{to}}}: both must name nodes"),
        ));
    }
    // Nodes that cannot exist, or a target set with no node this process may allocate
    // on, are errors before the call: in every environment, and never a missing
    // capability (with CAP_SYS_NICE the kernel still keeps only the caller's allowed
    // nodes, and refuses an empty remainder with EINVAL).
    crate::policy::check_migrate_nodes(OP, from, to)?;
    let own = pid == 0 || pid == rustix::process::getpid().as_raw_nonzero().get();
    let available = NumaCall::MigratePages.support()? == MempolicySupport::Available;
    // Read the target's ids first: a missing process is ESRCH in every environment.
    let same_user = if own { true } else { same_user(pid)? };
    if !own && available && !crate::capability::sys_nice() && !same_user {
        return Err(crate::capability::missing_sys_nice(
            OP,
            format!("process {pid} belongs to another user"),
        ));
    }
    // Both masks sized alike: the kernel reads the same maxnode for both.
    let possible = crate::node::possible_node_count()
        .max(from.last().map_or(0, |n| n.index() + 1))
        .max(to.last().map_or(0, |n| n.index() + 1));
    let (old, new) = (
        crate::node::KernelMask::new(from, possible),
        crate::node::KernelMask::new(to, possible),
    );
    // SAFETY: both masks hold `maxnode / 64` words.
    let result = unsafe {
        sys::migrate_pages(
            pid,
            old.maxnode(),
            old.words().as_ptr(),
            new.words().as_ptr(),
        )
    };
    match result {
        Ok(left) => Ok(Observed::Known(left as usize)),
        Err(errno) => degrade_or_error(NumaCall::MigratePages, errno, || {
            format!("pid={pid} from={from} to={to}")
        })
        .map(Observed::Degraded),
    }
}

/// Whether process `pid`'s real or saved user id matches our real or effective one, the
/// rule under which `migrate_pages` needs no capability.
fn same_user(pid: i32) -> Result<bool> {
    let path = format!("/proc/{pid}/status");
    let status = match std::fs::read_to_string(&path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::os(
                "migrate_pages",
                Errno::SRCH,
                format_args!("pid={pid}: no such process"),
            ));
        }
        Err(e) => return Err(Error::io("read", path, e)),
    };
    let ids: Vec<u32> = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|v| v.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let (uid, euid) = (
        rustix::process::getuid().as_raw(),
        rustix::process::geteuid().as_raw(),
    );
    let (real, saved) = (ids.first().copied(), ids.get(2).copied());
    Ok([real, saved]
        .iter()
        .flatten()
        .any(|&id| id == uid || id == euid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;

    #[test]
    fn numa_maps_never_attributes_a_mapping_that_reaches_past_the_range() {
        let page = page_size();
        let mut r = Region::anonymous(3 * page).unwrap();
        let start = r.as_ptr() as usize;
        let middle = [(start + page, start + 2 * page)];
        // Untouched: a line with no pages says "not present" exactly, even if the kernel
        // merged the region with a neighbour (whose pages would then be `merged`).
        let h = numa_maps_histogram(&middle).unwrap();
        assert_eq!((h.present(), h.source), (0, PagesSource::NumaMaps));
        assert_eq!(h.not_present + h.merged, 1, "{h:?}");

        r.as_mut_slice().unwrap().fill(1);
        // The middle page's line covers its two neighbours too: its count is not ours.
        let h = numa_maps_histogram(&middle).unwrap();
        assert_eq!((h.present(), h.merged, h.not_present), (0, 1, 0), "{h:?}");
        // The whole region: its own line counts (merged only if a neighbour joined it).
        let h = numa_maps_histogram(&[(start, start + 3 * page)]).unwrap();
        assert_eq!((h.present() + h.merged, h.not_present), (3, 0), "{h:?}");
        // Two spans covering a line between them count it whole.
        let h = numa_maps_histogram(&[(start, start + page), (start + page, start + 3 * page)])
            .unwrap();
        assert_eq!(h.present() + h.merged, 3, "{h:?}");
    }
}
