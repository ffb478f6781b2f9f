//! Region behaviour: release, placement, populate, alignment, file mappings.

mod common;

use std::io::Write;

use common::{Expect, degrade_here, expect, placement_here, whole};
use numapin::{Advice, Error, Invalid, NodeSet, Region, diag};

use numapin::policy::{MbindFlags, MemPolicy, Observed, Placement};

fn page() -> usize {
    numapin::page_size()
}

fn region_rss(r: &Region) -> u64 {
    let start = r.as_ptr() as usize;
    diag::smaps_in_range(start, start + r.len())
        .unwrap()
        .iter()
        .map(|e| e.rss)
        .sum()
}

#[test]
fn release_drops_rss_and_keeps_the_policy() {
    let pages = 64;
    // Fenced: smaps and numa_maps count this mapping alone.
    let mut r = Region::anonymous_fenced(pages * page()).unwrap();
    r.advise(Advice::NoHugePage).unwrap();
    let nodes = NodeSet::allowed().unwrap();
    let first = nodes.iter().next().unwrap();
    let policy = MemPolicy::Bind(std::iter::once(first).collect());
    let placement = r.bind(&policy, MbindFlags::empty()).unwrap();
    assert_eq!(placement.is_bound(), expect() == Expect::Full);

    r.as_mut_slice().unwrap().fill(0xAB);
    assert_eq!(region_rss(&r), (pages * page()) as u64);

    r.release(0..pages * page() / 2).unwrap();
    assert_eq!(region_rss(&r), (pages * page() / 2) as u64);

    // A write after release faults under the same policy.
    r.as_mut_slice().unwrap()[0] = 1;
    match r.policy_at(0).unwrap() {
        Observed::Known((p, _)) => assert_eq!(p, policy),
        Observed::Degraded(reason) => assert_eq!(Some(reason), degrade_here()),
    }
    if let Some(h) = placement_here(r.placement().unwrap()) {
        whole(&h, pages);
        // Unbound (a denied policy call), the pages land wherever the kernel likes.
        let on = if placement.is_bound() {
            h.on(first)
        } else {
            h.present()
        };
        assert_eq!(on, pages / 2 + 1, "{h:?}");
        assert_eq!((h.not_present, h.other), (pages / 2 - 1, 0));
    }
    // Released pages read back as zeroes (reading maps the shared zero page, which
    // move_pages would report as -EFAULT, so this comes after the histogram).
    assert!(r.as_slice()[1..pages * page() / 2].iter().all(|&b| b == 0));
    assert!(
        r.as_slice()[pages * page() / 2..]
            .iter()
            .all(|&b| b == 0xAB)
    );
}

#[test]
fn release_checks_its_range() {
    let mut r = Region::anonymous(4 * page()).unwrap();
    let len = 4 * page() as u64;
    // Each condition is a typed detail a caller can match, with the figures.
    match r.release(1..page()) {
        Err(Error::InvalidArgument {
            op: "Region::release",
            reason: Invalid::Misaligned {
                value: 1, align, ..
            },
        }) => assert_eq!(align, page() as u64),
        other => panic!("{other:?}"),
    }
    match r.release(0..5 * page()) {
        Err(Error::InvalidArgument {
            reason:
                Invalid::OutOfBounds {
                    start: 0,
                    end,
                    len: l,
                    within: "the region",
                    ..
                },
            ..
        }) => assert_eq!((end, l), (5 * page() as u64, len)),
        other => panic!("{other:?}"),
    }
    match r.slot(0..4 * page() + 1) {
        Err(Error::InvalidArgument {
            op: "Region::slot",
            reason: reason @ Invalid::OutOfBounds { end, .. },
        }) => {
            assert_eq!(end, len + 1);
            assert_eq!(
                reason.to_string(),
                format!(
                    "range 0..{} runs past the end of the region ({len} bytes)",
                    len + 1
                )
            );
        }
        other => panic!("{other:?}"),
    }
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 2 * page()..page();
    assert!(matches!(
        r.release(reversed),
        Err(Error::InvalidArgument { .. })
    ));
    r.release(page()..page()).unwrap();
    // An unaligned end rounds up to the page.
    r.as_mut_slice().unwrap().fill(3);
    r.release(0..10).unwrap();
    assert!(r.as_slice()[..page()].iter().all(|&b| b == 0));
    assert_eq!(r.as_slice()[page()], 3);
}

#[test]
fn placement_of_an_untouched_region_reports_not_present_and_faults_nothing() {
    let pages = 256;
    // Fenced: over a mapping merged with a neighbour test's unbound region, mincore here
    // (Linux 6.18) briefly counted the neighbour's pages being populated as ours.
    let r = Region::anonymous_fenced(pages * page()).unwrap();
    let before = region_rss(&r);
    let observed = r.placement().unwrap();
    assert_eq!(region_rss(&r), before);
    assert_eq!(before, 0);
    if let Some(h) = placement_here(observed) {
        whole(&h, pages);
        assert_eq!((h.present(), h.not_present, h.other), (0, pages, 0));
    }
}

#[test]
fn populate_write_makes_every_page_present_on_the_bound_nodes() {
    let pages = 128;
    // Fenced: unbound (a denied container), it would merge with a neighbouring test's
    // anonymous mapping.
    let mut r = Region::anonymous_fenced(pages * page()).unwrap();
    let nodes = NodeSet::allowed().unwrap();
    let _ = r
        .bind(&MemPolicy::Interleave(nodes), MbindFlags::empty())
        .unwrap();
    r.populate_write().unwrap();
    // mincore: exact for this range, whatever the mapping merged with.
    assert_eq!(
        numapin::resident_pages(r.as_ptr() as usize, r.len()).unwrap(),
        pages
    );
    if let Some(h) = placement_here(r.placement().unwrap()) {
        assert!(h.pages.keys().all(|n| nodes.contains(*n)), "{h:?}");
        whole(&h, pages);
        assert_eq!(h.present(), pages);
    }
}

#[test]
fn anonymous_aligned_is_aligned_and_checks_its_arguments() {
    let r = Region::anonymous_aligned(3 << 20, 2 << 20).unwrap();
    assert_eq!(r.as_ptr() as usize % (2 << 20), 0);
    assert_eq!(r.len(), 3 << 20);
    // The whole asked length is mapped (mincore fails with ENOMEM on a hole).
    assert_eq!(
        numapin::resident_pages(r.as_ptr() as usize, r.len()).unwrap(),
        0
    );
    for (len, align) in [
        (4096, 3 << 20),
        (4096, 1024),
        (0, 2 << 20),
        (usize::MAX - 4095, 2 << 20),
    ] {
        assert!(
            matches!(
                Region::anonymous_aligned(len, align),
                Err(Error::InvalidArgument { .. })
            ),
            "len {len} align {align}"
        );
    }
    assert!(matches!(
        Region::anonymous(0),
        Err(Error::InvalidArgument {
            reason: Invalid::Empty { .. },
            ..
        })
    ));
    assert!(matches!(
        Region::anonymous(usize::MAX),
        Err(Error::InvalidArgument {
            reason: Invalid::Overflow { .. },
            ..
        })
    ));
    match Region::anonymous_aligned(page(), 3 << 20) {
        Err(Error::InvalidArgument {
            op: "Region::anonymous_aligned",
            reason:
                Invalid::BadValue {
                    what: "align",
                    value,
                    ..
                },
        }) => assert_eq!(value, (3 << 20).to_string()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn lengths_round_up_to_pages() {
    let r = Region::anonymous(1).unwrap();
    assert_eq!(r.len(), page());
}

#[test]
fn file_mappings_are_read_only_and_refuse_bind() {
    let dir = std::env::temp_dir().join(format!("numapin-region-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("data.bin");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&vec![9u8; 3 * page()]).unwrap();
    drop(f);
    let f = std::fs::File::open(&path).unwrap();

    // SAFETY: the file is this test's own; nothing writes or truncates it while mapped.
    let mut r = unsafe { Region::map_file(&f, page() as u64, page() + 10) }.unwrap();
    assert_eq!(r.len(), page() + 10);
    assert!(r.as_slice().iter().all(|&b| b == 9));
    match r.bind(
        &MemPolicy::Bind(NodeSet::allowed().unwrap()),
        MbindFlags::empty(),
    ) {
        Err(Error::InvalidArgument {
            reason: reason @ Invalid::WrongBacking { .. },
            ..
        }) => {
            let reason = reason.to_string();
            assert!(reason.contains("page cache"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(r.as_mut_slice().is_err());
    assert!(r.populate_write().is_err());
    assert!(r.release(0..page()).is_err());
    // Past EOF would SIGBUS on access: refused up front.
    // SAFETY: as above; these calls are refused before mapping anything.
    unsafe {
        assert!(Region::map_file(&f, 0, 3 * page() + 1).is_err());
        assert!(Region::map_file(&f, 1, 10).is_err());
        assert!(Region::map_file(&f, 0, 0).is_err());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn memfd_regions_take_a_shared_policy() {
    let mut r = Region::memfd("numapin-test", 16 * page()).unwrap();
    // SAFETY: only asks whether there is a file.
    assert!(unsafe { r.memfd_file() }.is_some());
    let nodes = NodeSet::allowed().unwrap();
    let placement = r
        .bind(&MemPolicy::Interleave(nodes), MbindFlags::empty())
        .unwrap();
    assert_eq!(
        placement,
        degrade_here().map_or(Placement::Bound, Placement::Degraded)
    );
    r.populate_write().unwrap();
    r.as_mut_slice().unwrap().fill(5);
    if let Observed::Known((p, _)) = r.policy_at(0).unwrap() {
        assert_eq!(p, MemPolicy::Interleave(nodes));
    }
    // Release frees the memfd's pages too: they read back as zeroes.
    r.release(0..page()).unwrap();
    assert!(r.as_slice()[..page()].iter().all(|&b| b == 0));
    assert_eq!(r.as_slice()[page()], 5);
}

#[test]
fn regions_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Region>();
}

#[test]
fn populate_read_maps_pages_without_changing_them() {
    let mut r = Region::anonymous(8 * page()).unwrap();
    r.as_mut_slice().unwrap()[3 * page()] = 7;
    let start = r.as_ptr() as usize;
    assert_eq!(numapin::resident_pages(start, 8 * page()).unwrap(), 1);
    // Rounded out to whole pages: [page + 1, 3 * page + 1) covers pages 1, 2 and 3.
    r.populate_read(page() + 1..3 * page() + 1).unwrap();
    assert_eq!(numapin::resident_pages(start, 8 * page()).unwrap(), 3);
    assert_eq!(r.as_slice()[3 * page()], 7);
    assert!(r.populate_read(0..8 * page() + 1).is_err());
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 2..1;
    assert!(r.populate_read(reversed).is_err());
    r.populate_read(5..5).unwrap();
}

#[test]
fn bind_range_refuses_a_shared_file_mapping_like_region_bind() {
    let dir = std::env::temp_dir().join(format!("numapin-bindfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("data.bin");
    std::fs::write(&path, vec![1u8; 2 * page()]).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    // What memmap2's `Mmap::map` makes: a shared read-only mapping of a regular file.
    // SAFETY: a new mapping of our own file, unmapped below; nothing else uses it.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            2 * page(),
            rustix::mm::ProtFlags::READ,
            rustix::mm::MapFlags::SHARED,
            &file,
            0,
        )
    }
    .unwrap();
    let policy = MemPolicy::Bind(NodeSet::allowed().unwrap());
    // f_type's integer type differs between architectures.
    #[allow(clippy::unnecessary_cast)]
    let on_tmpfs = rustix::fs::statfs(&path).unwrap().f_type as i64 == 0x0102_1994;
    // SAFETY: the range is our own mapping; binding it would not change its contents.
    let result =
        unsafe { numapin::bind_range(ptr.cast(), 2 * page(), &policy, MbindFlags::empty()) };
    if on_tmpfs {
        // tmpfs is shared memory with a shared policy: binding is meaningful there.
        assert!(result.is_ok(), "{result:?}");
    } else {
        match result {
            Err(Error::InvalidArgument {
                reason: reason @ Invalid::WrongBacking { .. },
                ..
            }) => {
                let reason = reason.to_string();
                assert!(reason.contains("page cache"), "{reason}")
            }
            other => panic!("bind_range over a shared file mapping gave {other:?}"),
        }
    }
    // Anonymous memory next to it is still bound as before.
    let anon = Region::anonymous(page()).unwrap();
    // SAFETY: our own region, untouched.
    let placement =
        unsafe { numapin::bind_range(anon.as_ptr(), page(), &policy, MbindFlags::empty()) }
            .unwrap();
    assert_eq!(
        placement,
        common::degrade_here().map_or(Placement::Bound, Placement::Degraded)
    );
    // SAFETY: unmapping the mapping made above.
    unsafe { rustix::mm::munmap(ptr, 2 * page()) }.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_region_is_as_ref_bytes() {
    let mut r = Region::anonymous(page()).unwrap();
    r.as_mut_slice().unwrap()[7] = 9;
    fn sum(bytes: impl AsRef<[u8]>) -> u64 {
        bytes.as_ref().iter().map(|&b| u64::from(b)).sum()
    }
    assert_eq!(sum(&r), 9);
    assert_eq!(AsRef::<[u8]>::as_ref(&r).len(), page());
}

/// Maps `len` bytes private anonymous read-write exactly at `addr`, never over another
/// mapping (`MAP_FIXED_NOREPLACE`: EEXIST when something is mapped there).
fn map_at(addr: usize, len: usize) -> Result<*mut std::ffi::c_void, rustix::io::Errno> {
    use rustix::mm::{MapFlags, ProtFlags};
    // SAFETY: MAP_FIXED_NOREPLACE never replaces a mapping: it makes a fresh one at
    // `addr` or fails.
    unsafe {
        rustix::mm::mmap_anonymous(
            addr as *mut _,
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE | MapFlags::FIXED_NOREPLACE,
        )
    }
}

#[test]
fn a_fenced_region_keeps_its_pages_beside_a_same_flag_neighbour() {
    let pages = 4;
    let len = pages * page();
    let mut r = Region::anonymous_fenced(len).unwrap();
    let (start, end) = (r.as_ptr() as usize, r.as_ptr() as usize + len);
    // The guards hold the addresses right at both ends.
    assert_eq!(map_at(end, page()).unwrap_err(), rustix::io::Errno::EXIST);
    assert_eq!(
        map_at(start - page(), page()).unwrap_err(),
        rustix::io::Errno::EXIST
    );
    // Same-flag neighbours (private anonymous read-write, default policy) as close as
    // the guards allow, pages touched. (Where another thread's mapping already sits
    // there, that mapping is the neighbour.)
    let neighbours: Vec<_> = [end + page(), start - 3 * page()]
        .into_iter()
        .filter_map(|at| map_at(at, 2 * page()).ok())
        .collect();
    for &n in &neighbours {
        // SAFETY: our own fresh two-page mapping, read-write, referenced by nothing else.
        unsafe { std::ptr::write_bytes(n.cast::<u8>(), 1, 2 * page()) };
    }
    r.as_mut_slice().unwrap()[0] = 1;
    r.as_mut_slice().unwrap()[2 * page()] = 1;
    // /proc/self/maps: one mapping, exactly the region.
    let maps = diag::maps_entries_in(start, end).unwrap();
    let spans: Vec<_> = maps.iter().map(|m| (m.start, m.end)).collect();
    assert_eq!(spans, [(start, end)]);
    // /proc/self/numa_maps, read here directly: the line at the region's start is its
    // own, with the two pages touched (numa_maps works wherever /proc is mounted).
    let entry = diag::numa_maps_at(r.as_ptr())
        .unwrap()
        .expect("a numa_maps line starting at the region");
    assert_eq!(entry.pages.values().sum::<u64>(), 2, "{entry:?}");
    // The region's own placement, from move_pages or numa_maps, agrees.
    if let Some(h) = placement_here(r.placement().unwrap()) {
        whole(&h, pages);
        assert_eq!((h.present(), h.not_present), (2, 2), "{h:?}");
    }
    for n in neighbours {
        // SAFETY: the mapping made above; nothing references it any more.
        unsafe { rustix::mm::munmap(n, 2 * page()) }.unwrap();
    }
}

#[test]
fn fenced_regions_check_their_arguments_and_align() {
    for len in [
        0,
        usize::MAX,
        usize::MAX - page() + 2,
        usize::MAX - 2 * page(),
    ] {
        assert!(
            matches!(
                Region::anonymous_fenced(len),
                Err(Error::InvalidArgument { .. })
            ),
            "len {len}"
        );
    }
    for (len, align) in [
        (page(), 3 << 20),
        (page(), 1024),
        (0, 2 << 20),
        (usize::MAX - 4095, 2 << 20),
        (usize::MAX / 2, 1 << (usize::BITS - 1)),
    ] {
        assert!(
            matches!(
                Region::anonymous_fenced_aligned(len, align),
                Err(Error::InvalidArgument { .. })
            ),
            "len {len} align {align}"
        );
    }
    // Fits the arithmetic, not the address space: mmap's ENOMEM.
    let err = Region::anonymous_fenced_aligned(page(), 1 << (usize::BITS - 1)).unwrap_err();
    assert_eq!(err.errno(), Some(numapin::Errno::NOMEM), "{err}");
    let r = Region::anonymous_fenced_aligned(3 << 20, 2 << 20).unwrap();
    let start = r.as_ptr() as usize;
    assert_eq!(start % (2 << 20), 0);
    assert_eq!(r.len(), 3 << 20);
    // The region is mapped whole (mincore fails with ENOMEM on a hole) and alone.
    assert_eq!(numapin::resident_pages(start, r.len()).unwrap(), 0);
    let spans: Vec<_> = diag::maps_entries_in(start - page(), start + r.len() + page())
        .unwrap()
        .iter()
        .map(|m| (m.start, m.end, m.perms.clone()))
        .collect();
    assert_eq!(
        spans,
        [
            (start - page(), start, "---p".to_string()),
            (start, start + r.len(), "rw-p".to_string()),
            (
                start + r.len(),
                start + r.len() + page(),
                "---p".to_string()
            ),
        ]
    );
}
