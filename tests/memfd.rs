//! memfd regions: seals, hugetlb pages, memory breakdown, and moving pages.

mod common;

use common::{Expect, degrade_here, degrade_pages_here, expect, expect_pages, pages_source_here};
use numapin::{Error, HugePageSize, Invalid, NodeSet, Region, Seals, diag};

use numapin::policy::{MbindFlags, MemPolicy, Observed};

fn page() -> usize {
    numapin::page_size()
}

#[test]
fn seals_stop_resizing_and_future_writes_but_not_this_mapping() {
    let mut r = Region::memfd("numapin-seal", 4 * page()).unwrap();
    r.seal(Seals::GROW | Seals::SHRINK).unwrap();
    assert_eq!(r.seals().unwrap(), Seals::GROW | Seals::SHRINK);
    // SAFETY: the test only tries to resize, which the seals refuse.
    let file = unsafe { r.memfd_file() }.unwrap();
    assert_eq!(
        file.set_len(8 * page() as u64).unwrap_err().raw_os_error(),
        Some(libc::EPERM)
    );
    assert_eq!(
        file.set_len(page() as u64).unwrap_err().raw_os_error(),
        Some(libc::EPERM)
    );

    // WRITE is refused while this writable mapping exists, with the way out named.
    match r.seal(Seals::WRITE) {
        Err(Error::InvalidArgument { reason, .. }) => {
            let reason = reason.to_string();
            assert!(reason.contains("FUTURE_WRITE"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    r.seal(Seals::FUTURE_WRITE).unwrap();
    r.as_mut_slice().unwrap()[0] = 7; // the existing mapping still writes
    assert_eq!(r.as_slice()[0], 7);
    use std::os::unix::fs::FileExt;
    // SAFETY: the write is refused by FUTURE_WRITE; no slice is live anyway.
    let err = unsafe { r.memfd_file() }
        .unwrap()
        .write_at(b"x", 0)
        .unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(libc::EPERM),
        "write(2) after FUTURE_WRITE"
    );
    // Anonymous regions have no seals.
    assert!(
        Region::anonymous(page())
            .unwrap()
            .seal(Seals::GROW)
            .is_err()
    );
}

#[test]
fn hugetlb_memfd_without_reserved_pages_says_how_to_reserve_them() {
    let size = HugePageSize::Size2M;
    let wanted = 4;
    let available = size.available();
    match Region::memfd_with("numapin-huge", wanted * size.bytes(), Some(size)) {
        Ok(mut r) => {
            // Pages were reserved: every page can be touched, no SIGBUS.
            assert!(available.unwrap_or(0) >= wanted);
            r.populate_write().unwrap();
            r.as_mut_slice().unwrap().fill(3);
            assert_eq!(r.memory().unwrap().hugetlb, (wanted * size.bytes()) as u64);
        }
        Err(e @ Error::HugePages { .. }) => {
            assert!(
                available.unwrap_or(0) < wanted,
                "{e} with {available:?} free"
            );
            // Where a pool was promised (the VM reserves one), the success path must run.
            assert!(
                std::env::var("NUMAPIN_HUGEPAGES").is_err(),
                "{e} though the environment reserved huge pages"
            );
            let text = e.to_string();
            assert!(
                text.contains("vm.nr_hugepages") && text.contains(&format!("{wanted} huge pages")),
                "{text}"
            );
        }
        Err(e) => panic!("{e}"),
    }
    // Lengths round up to the huge page size.
    if let Ok(r) = Region::memfd_with("numapin-huge-round", 1, Some(size)) {
        assert_eq!(r.len(), size.bytes());
    }
}

/// Held by a test that forks and by those that read smaps or move pages: `Locked` and
/// `Private_*` are proportional (PSS) figures, and a fork shares every private page with the
/// child until it execs, halving them (the CI's 4-node VM saw `Locked` at 32 of 64 pages);
/// `move_pages` refuses a page mapped by two processes with EACCES (the VM saw all 32 pages
/// refused while the uid test forked).
static FORKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn memory_breakdown_tells_anonymous_from_shared() {
    let _no_fork = FORKING.lock().unwrap_or_else(|e| e.into_inner());
    // Fenced: smaps must count this mapping alone.
    let mut anon = Region::anonymous_fenced(64 * page()).unwrap();
    anon.advise(numapin::Advice::DontDump).unwrap();
    anon.as_mut_slice().unwrap().fill(1);
    let a = anon.memory().unwrap();
    assert_eq!(
        (a.rss, a.anonymous, a.file_backed()),
        ((64 * page()) as u64, (64 * page()) as u64, 0)
    );
    assert_eq!(a.private, a.rss);

    let mut shm = Region::memfd("numapin-breakdown", 32 * page()).unwrap();
    shm.as_mut_slice().unwrap().fill(2);
    let m = shm.memory().unwrap();
    assert_eq!(
        (m.rss, m.anonymous, m.file_backed()),
        ((32 * page()) as u64, 0, (32 * page()) as u64)
    );
    anon.lock().unwrap();
    assert_eq!(anon.memory().unwrap().locked, (64 * page()) as u64);
    anon.unlock().unwrap();
    let process = diag::process_memory().unwrap();
    assert!(process.rss >= a.rss + m.rss && process.anonymous >= a.anonymous);
}

#[test]
fn migrate_and_move_pages_report_what_moved() {
    let _no_fork = FORKING.lock().unwrap_or_else(|e| e.into_inner());
    let nodes = NodeSet::allowed().unwrap();
    let target = nodes.iter().last().unwrap();
    // Base pages (with THP `always`, the VM, move_pages refuses a huge page with EACCES)
    // in a mapping of its own, which numa_maps counts alone.
    let mut r = Region::anonymous_fenced(64 * page()).unwrap();
    r.advise(numapin::Advice::NoHugePage).unwrap();
    r.as_mut_slice().unwrap()[..32 * page()].fill(5);
    // move_pages is a page call: Docker with SYS_NICE still denies it.
    match (expect_pages(), r.move_pages_to(target).unwrap()) {
        (Expect::Full, Observed::Known(report)) => {
            assert_eq!(
                (report.on_target, report.not_present, report.left_behind),
                (32, 32, 0),
                "{report:?}"
            );
            assert!(report.refused.is_empty(), "{report:?}");
            assert_eq!(
                (report.source, report.merged),
                (numapin::PagesSource::MovePages, 0)
            );
        }
        (_, Observed::Degraded(reason)) => assert_eq!(Some(reason), degrade_pages_here()),
        (e, other) => panic!("{e:?}: {other:?}"),
    }
    // migrate is mbind(MOVE), a policy call; its counts come from move_pages or, where
    // the page calls are denied, numa_maps.
    let to: NodeSet = std::iter::once(target).collect();
    match (expect(), r.migrate(&to).unwrap()) {
        (Expect::Full, Observed::Known(report)) => {
            assert_eq!(Some(report.source), pages_source_here(), "{report:?}");
            // Fenced: a mapping of its own.
            assert_eq!(report.merged, 0, "{report:?}");
            assert_eq!(
                (report.on_target, report.left_behind, report.not_present),
                (32, 0, 32),
                "{report:?}"
            );
            assert_eq!(
                r.policy_at(0).unwrap(),
                Observed::Known((MemPolicy::Bind(to), numapin::policy::ModeFlags::empty()))
            );
        }
        (_, Observed::Degraded(reason)) => assert_eq!(Some(reason), degrade_here()),
        (e, other) => panic!("{e:?}: {other:?}"),
    }
    assert!(r.as_slice()[..32 * page()].iter().all(|&b| b == 5));
    // An invalid target node is an error in every environment (checked before the call).
    let missing = numapin::Node(numapin::possible_node_count() as u16 + 5);
    assert!(matches!(
        r.move_pages_to(missing),
        Err(Error::InvalidArgument {
            op: "move_pages",
            ..
        })
    ));
}

#[test]
fn capability_checks_name_cap_sys_nice() {
    std::thread::spawn(|| {
        // Capabilities are per thread: drop CAP_SYS_NICE here only.
        let _ = caps::drop(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_SYS_NICE,
        );
        assert!(!numapin::capability::sys_nice());
        let r = Region::anonymous(page()).unwrap();
        let p = MemPolicy::Bind(NodeSet::allowed().unwrap());
        match (expect(), r.bind(&p, MbindFlags::MOVE_ALL)) {
            (
                Expect::Full,
                Err(Error::MissingCapability {
                    op: "mbind",
                    cap: "CAP_SYS_NICE",
                    why,
                }),
            ) => assert!(why.contains("MOVE_ALL"), "{why}"),
            (Expect::Full, other) => panic!("{other:?}"),
            (_, other) => assert_eq!(
                other.ok(),
                degrade_here().map(numapin::policy::Placement::Degraded)
            ),
        }
        // migrate_pages of this very process to nodes of its own cpuset needs no
        // capability.
        let nodes = NodeSet::allowed().unwrap();
        match numapin::migrate_process(0, &nodes, &nodes).unwrap() {
            Observed::Known(left) => assert_eq!((expect_pages(), left), (Expect::Full, 0)),
            Observed::Degraded(reason) => assert_eq!(Some(reason), degrade_pages_here()),
        }
        // A node that does not exist is no missing capability (CAP_SYS_NICE would not
        // make it exist): refused naming it, before the call, in every environment.
        let missing = numapin::Node(numapin::possible_node_count() as u16);
        let outside: NodeSet = std::iter::once(missing).collect();
        match numapin::migrate_process(0, &nodes, &outside) {
            Err(Error::InvalidArgument {
                op: "migrate_pages",
                reason: reason @ Invalid::NoSuchNode { .. },
            }) => {
                let Invalid::NoSuchNode { node, .. } = reason else {
                    unreachable!()
                };
                assert_eq!(node, missing.index());
                let reason = reason.to_string();
                assert!(
                    reason.contains(&format!("node {missing} does not exist")),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
        // Target nodes outside the cpuset but with some inside do need it: the kernel's
        // EPERM where the probe passed is that capability, named; where a profile denies
        // the call it degrades. Only where such a node exists (an allowed set smaller
        // than the nodes with memory).
        let support = numapin::probe().unwrap();
        if let Some(other) = support.nodes_with_memory.difference(&nodes).iter().next() {
            let mut wider = nodes;
            wider.insert(other);
            match (expect_pages(), numapin::migrate_process(0, &nodes, &wider)) {
                (
                    Expect::Full,
                    Err(Error::MissingCapability {
                        op: "migrate_pages",
                        cap: "CAP_SYS_NICE",
                        ..
                    }),
                ) => {}
                (Expect::Full, other) => panic!("{other:?}"),
                (_, other) => {
                    assert_eq!(other.ok(), degrade_pages_here().map(Observed::Degraded))
                }
            }
        }
        // Nor does a nonexistent process get past the checks.
        assert!(numapin::migrate_process(i32::MAX, &nodes, &nodes).is_err());
        assert!(numapin::migrate_process(0, &NodeSet::new(), &nodes).is_err());
    })
    .join()
    .unwrap();
}

#[test]
fn moving_another_users_pages_without_cap_sys_nice_is_named_up_front() {
    use std::os::unix::process::CommandExt;
    // Setting the uid makes std fork (not posix_spawn): keep smaps readers out meanwhile.
    let child = {
        let _forking = FORKING.lock().unwrap_or_else(|e| e.into_inner());
        std::process::Command::new("sleep")
            .arg("30")
            .uid(65534)
            .gid(65534)
            .spawn()
    };
    let Ok(mut child) = child else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOT RUN: moving_another_users_pages_without_cap_sys_nice_is_named_up_front needs to start a process as uid 65534 (root outside a user namespace)"
        );
        return;
    };
    let pid = child.id() as i32;
    let result = std::thread::spawn(move || {
        let _ = caps::drop(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_SYS_NICE,
        );
        let nodes = NodeSet::allowed().unwrap();
        numapin::migrate_process(pid, &nodes, &nodes)
    })
    .join()
    .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    match (expect_pages(), result) {
        (
            Expect::Full,
            Err(Error::MissingCapability {
                op: "migrate_pages",
                cap: "CAP_SYS_NICE",
                why,
            }),
        ) => assert!(why.contains("another user"), "{why}"),
        // Denied: the container's refusal degrades, as for every NUMA call; without NUMA
        // there is no call to need a capability for.
        (Expect::Denied | Expect::Unsupported, Ok(Observed::Degraded(reason))) => {
            assert_eq!(Some(reason), degrade_pages_here())
        }
        (e, other) => panic!("{e:?}: {other:?}"),
    }
}
