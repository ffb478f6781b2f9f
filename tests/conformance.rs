//! Kernel conformance of the policy calls, through numapin-sys and through the typed
//! layer, each asserting the exact errno the kernel (or the environment's seccomp
//! filter) gives.

mod common;

use std::ffi::c_void;
use std::ptr;

use common::{Expect, errno_here, expect, ok_here};
use numapin::{Errno, Error, Invalid, NodeSet, Region};

use numapin::policy::{MbindFlags, MemPolicy, ModeFlags, Observed, Placement};
use numapin_sys as sys;

fn page() -> usize {
    numapin::page_size()
}

/// A mask with the first allowed node, sized by the maxnode rule.
fn one_node_mask() -> (Vec<u64>, u64) {
    let first = NodeSet::allowed().unwrap().iter().next().unwrap();
    let set: NodeSet = std::iter::once(first).collect();
    let m = set.as_kernel_mask();
    (m.words().to_vec(), m.maxnode())
}

fn raw_mbind(
    r: &Region,
    offset: usize,
    len: usize,
    mode: i32,
    mask: Option<&(Vec<u64>, u64)>,
    flags: u32,
) -> Result<(), Errno> {
    let (ptr, maxnode) = mask.map_or((ptr::null(), 0), |(w, m)| (w.as_ptr(), *m));
    // SAFETY: the range is inside (or deliberately misaligned within) our own region.
    unsafe {
        sys::mbind(
            r.as_ptr().wrapping_add(offset).cast(),
            len,
            mode,
            ptr,
            maxnode,
            flags,
        )
    }
}

#[test]
fn sys_default_with_a_mask_is_einval() {
    let r = Region::anonymous(page()).unwrap();
    let mask = one_node_mask();
    assert_eq!(
        raw_mbind(&r, 0, page(), sys::MPOL_DEFAULT, Some(&mask), 0),
        Err(errno_here(Errno::INVAL))
    );
    // SAFETY: a correctly sized mask; the thread policy is not changed on EINVAL.
    let r2 = unsafe { sys::set_mempolicy(sys::MPOL_DEFAULT, mask.0.as_ptr(), mask.1) };
    assert_eq!(r2, Err(errno_here(Errno::INVAL)));
}

#[test]
fn sys_bind_and_interleave_with_an_empty_mask_are_einval() {
    let r = Region::anonymous(page()).unwrap();
    let empty = (vec![0u64; one_node_mask().0.len()], one_node_mask().1);
    for mode in [sys::MPOL_BIND, sys::MPOL_INTERLEAVE] {
        assert_eq!(
            raw_mbind(&r, 0, page(), mode, Some(&empty), 0),
            Err(errno_here(Errno::INVAL)),
            "mode {mode}"
        );
        assert_eq!(
            raw_mbind(&r, 0, page(), mode, None, 0),
            Err(errno_here(Errno::INVAL)),
            "mode {mode}, null mask"
        );
    }
}

#[test]
fn sys_local_with_a_mask_is_einval() {
    let r = Region::anonymous(page()).unwrap();
    let mask = one_node_mask();
    assert_eq!(
        raw_mbind(&r, 0, page(), sys::MPOL_LOCAL, Some(&mask), 0),
        Err(errno_here(Errno::INVAL))
    );
    assert_eq!(
        raw_mbind(&r, 0, page(), sys::MPOL_LOCAL, None, 0),
        ok_here()
    );
}

#[test]
fn sys_unknown_mode_and_flags_are_einval() {
    let r = Region::anonymous(page()).unwrap();
    let mask = one_node_mask();
    for mode in [sys::MPOL_MAX, 100, !sys::MPOL_MODE_FLAGS] {
        assert_eq!(
            raw_mbind(&r, 0, page(), mode, Some(&mask), 0),
            Err(errno_here(Errno::INVAL)),
            "mode {mode}"
        );
    }
    for flags in [
        0x80,
        0x8, /* MPOL_MF_LAZY is kernel-internal */
        1 << 31,
    ] {
        assert_eq!(
            raw_mbind(&r, 0, page(), sys::MPOL_BIND, Some(&mask), flags),
            Err(errno_here(Errno::INVAL)),
            "flags {flags:#x}"
        );
    }
    // STATIC and RELATIVE exclude each other.
    let both = sys::MPOL_BIND | sys::MPOL_F_STATIC_NODES | sys::MPOL_F_RELATIVE_NODES;
    assert_eq!(
        raw_mbind(&r, 0, page(), both, Some(&mask), 0),
        Err(errno_here(Errno::INVAL))
    );
}

#[test]
fn sys_unaligned_start_is_einval_and_len_zero_is_ok() {
    let r = Region::anonymous(2 * page()).unwrap();
    let mask = one_node_mask();
    assert_eq!(
        raw_mbind(&r, 1, page(), sys::MPOL_BIND, Some(&mask), 0),
        Err(errno_here(Errno::INVAL))
    );
    assert_eq!(
        raw_mbind(&r, 0, 0, sys::MPOL_BIND, Some(&mask), 0),
        ok_here()
    );
}

#[test]
fn sys_range_with_a_hole_is_efault() {
    if !common::alone("sys_range_with_a_hole_is_efault") {
        return;
    }
    let mask = one_node_mask();
    let result = with_hole(|r| raw_mbind(r, 0, 3 * page(), sys::MPOL_BIND, Some(&mask), 0));
    assert_eq!(result, Err(errno_here(Errno::FAULT)));
}

/// Runs `f` on a 3-page region whose middle page is unmapped. Only in a test run
/// [`common::alone`]: with other test threads mapping, the kernel may reuse the gap for
/// one of their pages between the `munmap` and `f` (and unmap it again before any check
/// after `f` could see it), and `f` would meet a mapped page where the hole should be.
/// The region is never dropped whole: its middle page is not ours.
fn with_hole<T>(f: impl FnOnce(&Region) -> T) -> T {
    let r = Region::anonymous(3 * page()).unwrap();
    let start = r.as_ptr();
    // SAFETY: punching the middle page of our own region; nothing references it.
    unsafe { rustix::mm::munmap(start.add(page()).cast::<c_void>(), page()) }.unwrap();
    let out = f(&r);
    // mincore answers ENOMEM for an unmapped page: alone, nothing else maps.
    assert!(
        numapin::resident_pages(start as usize + page(), page()).is_err(),
        "the hole was filled"
    );
    std::mem::forget(r);
    // SAFETY: the two outer pages are ours alone; the middle one is unmapped.
    unsafe {
        rustix::mm::munmap(start.cast::<c_void>(), page()).unwrap();
        rustix::mm::munmap(start.add(2 * page()).cast::<c_void>(), page()).unwrap();
    }
    out
}

#[test]
fn sys_policies_read_back_as_set() {
    let r = Region::anonymous(page()).unwrap();
    let mask = one_node_mask();
    for mode in [sys::MPOL_BIND, sys::MPOL_INTERLEAVE, sys::MPOL_PREFERRED] {
        assert_eq!(raw_mbind(&r, 0, page(), mode, Some(&mask), 0), ok_here());
        if expect() != Expect::Full {
            continue;
        }
        let mut got_mode = -1;
        let mut got = vec![0u64; mask.0.len()];
        // SAFETY: out-pointers sized for maxnode; the address is our own region.
        unsafe {
            sys::get_mempolicy(
                &mut got_mode,
                got.as_mut_ptr(),
                mask.1,
                r.as_ptr().cast(),
                sys::MPOL_F_ADDR,
            )
        }
        .unwrap();
        assert_eq!((got_mode, &got), (mode, &mask.0), "mode {mode}");
    }
}

#[test]
fn sys_get_mempolicy_with_maxnode_below_possible_nodes_is_einval() {
    if expect() != Expect::Full {
        return;
    }
    let mut mode = 0;
    let mut word = 0u64;
    // maxnode 0 is below any possible node count.
    // SAFETY: valid out-pointers.
    let r = unsafe { sys::get_mempolicy(&mut mode, &mut word, 0, ptr::null_mut(), 0) };
    assert_eq!(r, Err(Errno::INVAL));
}

// ---- the same through the typed layer ----

#[test]
fn typed_empty_set_is_an_error_naming_the_policy_in_every_environment() {
    let r = Region::anonymous(page()).unwrap();
    for p in [
        MemPolicy::Bind(NodeSet::new()),
        MemPolicy::Interleave(NodeSet::new()),
    ] {
        match r.bind(&p, MbindFlags::empty()) {
            Err(Error::InvalidArgument {
                reason: reason @ Invalid::Empty { .. },
                ..
            }) => {
                let reason = reason.to_string();
                assert!(reason.contains(p.name()), "{reason}")
            }
            other => panic!("{p:?}: {other:?}"),
        }
        assert!(numapin::policy::set_thread_policy(&p).is_err());
    }
}

fn expect_bind(result: numapin::Result<Placement>, full: Errno) {
    match (expect(), result) {
        (Expect::Full, Err(e)) => assert_eq!(e.errno(), Some(full), "{e}"),
        (Expect::Denied, Ok(p)) => {
            assert_eq!(
                p,
                Placement::Degraded(numapin::policy::DegradeReason::Denied)
            )
        }
        (Expect::Unsupported, Ok(p)) => {
            assert_eq!(
                p,
                Placement::Degraded(numapin::policy::DegradeReason::Unsupported)
            )
        }
        (e, other) => panic!("{e:?}: {other:?}"),
    }
}

/// What the raw calls above answer `EINVAL` (or `EPERM`/`ENOSYS` where the kernel is not
/// reached) the typed layer refuses before the call, the same in every environment
/// (issue 19 §6; tests/invalid_requests.rs has the full set).
#[test]
fn typed_unknown_flags_and_exclusive_mode_flags_are_refused_in_every_environment() {
    let r = Region::anonymous(page()).unwrap();
    let p = MemPolicy::Bind(NodeSet::allowed().unwrap());
    let refused = |result: numapin::Result<Placement>| match result {
        Err(Error::InvalidArgument {
            op: "mbind",
            reason,
        }) => reason.to_string(),
        other => panic!("{other:?}"),
    };
    let reason = refused(r.bind(&p, MbindFlags::from_bits_retain(0x80)));
    assert!(reason.contains("bit(s) 0x80"), "{reason}");
    let both = ModeFlags::STATIC_NODES | ModeFlags::RELATIVE_NODES;
    let reason = refused(r.bind_with(&p, both, MbindFlags::empty()));
    assert!(reason.contains("exclude each other"), "{reason}");
}

#[test]
fn typed_hole_is_efault_and_the_error_names_the_range() {
    if !common::alone("typed_hole_is_efault_and_the_error_names_the_range") {
        return;
    }
    let p = MemPolicy::Bind(NodeSet::allowed().unwrap());
    let result = with_hole(|r| r.bind(&p, MbindFlags::empty()));
    if let Err(e) = &result {
        let text = e.to_string();
        assert!(
            text.contains("mbind(")
                && text.contains("EFAULT")
                && text.contains(&format!("len={}", 3 * page())),
            "{text}"
        );
    }
    expect_bind(result, Errno::FAULT);
}

#[test]
fn typed_bind_range_checks_alignment_in_every_environment() {
    let r = Region::anonymous(2 * page()).unwrap();
    let p = MemPolicy::Bind(NodeSet::allowed().unwrap());
    // SAFETY: inside our own region.
    let result = unsafe { numapin::bind_range(r.as_ptr().add(1), page(), &p, MbindFlags::empty()) };
    match result {
        Err(Error::InvalidArgument {
            op: "bind_range",
            reason:
                reason @ Invalid::Misaligned {
                    value,
                    align: 4096..,
                    ..
                },
        }) => {
            assert_eq!(value, r.as_ptr() as u64 + 1);
            assert!(reason.to_string().contains("not aligned"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // SAFETY: inside our own region; len 0 changes nothing.
    let zero = unsafe { numapin::bind_range(r.as_ptr(), 0, &p, MbindFlags::empty()) }.unwrap();
    assert_eq!(zero.is_bound(), expect() == Expect::Full);
}

#[test]
fn typed_policies_read_back_as_set() {
    let nodes = NodeSet::allowed().unwrap();
    let first = nodes.iter().next().unwrap();
    let r = Region::anonymous(page()).unwrap();
    for p in [
        MemPolicy::Bind(nodes),
        MemPolicy::Interleave(nodes),
        MemPolicy::Preferred(first),
        MemPolicy::PreferredMany(nodes),
        MemPolicy::Local,
    ] {
        let placement = r.bind(&p, MbindFlags::empty()).unwrap();
        match (expect(), r.policy_at(0).unwrap()) {
            (Expect::Full, Observed::Known((got, flags))) => {
                assert!(placement.is_bound());
                assert_eq!((got, flags), (p, ModeFlags::empty()));
            }
            (_, Observed::Degraded(reason)) => assert_eq!(placement, Placement::Degraded(reason)),
            (e, other) => panic!("{e:?}: {other:?}"),
        }
    }
    let placement = r
        .bind_with(
            &MemPolicy::Bind(nodes),
            ModeFlags::STATIC_NODES,
            MbindFlags::empty(),
        )
        .unwrap();
    if placement.is_bound() {
        assert_eq!(
            r.policy_at(0).unwrap(),
            Observed::Known((MemPolicy::Bind(nodes), ModeFlags::STATIC_NODES))
        );
    }
}

#[test]
fn typed_move_of_touched_pages_is_accepted() {
    let mut r = Region::anonymous(4 * page()).unwrap();
    r.as_mut_slice().unwrap().fill(7);
    let p = MemPolicy::Bind(NodeSet::allowed().unwrap());
    let placement = r.bind(&p, MbindFlags::MOVE | MbindFlags::STRICT).unwrap();
    assert_eq!(placement.is_bound(), expect() == Expect::Full);
    assert!(r.as_slice().iter().all(|&b| b == 7));
}

/// Whether this process is in the initial user namespace (where CAP_SYS_NICE counts for
/// `MPOL_MF_MOVE_ALL`).
fn in_initial_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map")
        .is_ok_and(|m| m.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"])
}

#[test]
fn move_all_needs_cap_sys_nice_in_the_initial_user_namespace() {
    let mut r = Region::anonymous(2 * page()).unwrap();
    r.as_mut_slice().unwrap().fill(1);
    let p = MemPolicy::Bind(NodeSet::allowed().unwrap());
    let result = r.bind(&p, MbindFlags::MOVE_ALL);
    let capable = in_initial_user_namespace() && numapin::probe().unwrap().cap_sys_nice;
    match (expect(), result) {
        (Expect::Full, Ok(Placement::Bound)) => {
            assert!(capable, "MOVE_ALL succeeded without CAP_SYS_NICE")
        }
        (
            Expect::Full,
            Err(Error::MissingCapability {
                op: "mbind",
                cap: "CAP_SYS_NICE",
                why,
            }),
        ) => assert!(!capable, "{why}"),
        (Expect::Denied, Ok(p)) => {
            assert_eq!(
                p,
                Placement::Degraded(numapin::policy::DegradeReason::Denied)
            )
        }
        (Expect::Unsupported, Ok(p)) => {
            assert_eq!(
                p,
                Placement::Degraded(numapin::policy::DegradeReason::Unsupported)
            )
        }
        (e, other) => panic!("{e:?}: {other:?}"),
    }
}

#[test]
fn node_ids_the_mask_or_the_machine_cannot_hold_are_refused_by_name() {
    let r = Region::anonymous(page()).unwrap();
    // Beyond the mask width: used to become an empty mask, which the kernel reads as
    // local allocation, with bind returning Ok(Bound).
    for id in [1024u16, 4096, u16::MAX] {
        let p = MemPolicy::Preferred(numapin::Node(id));
        assert_eq!(p.to_string(), format!("prefer:{id}"));
        let err = p.validate().unwrap_err().to_string();
        assert!(err.contains(&format!("node {id}")), "{err}");
        assert!(r.bind(&p, MbindFlags::empty()).is_err());
        assert!(numapin::policy::set_thread_policy(&p).is_err());
    }
    // Beyond this machine's possible nodes: named before any call, in every environment.
    let possible = numapin::possible_node_count();
    if possible < numapin::MAX_NODES {
        let node = numapin::Node(possible as u16);
        let bind = MemPolicy::Bind(std::iter::once(node).collect());
        match r.bind(&bind, MbindFlags::empty()) {
            Err(e @ Error::InvalidArgument { .. }) => {
                let text = e.to_string();
                assert!(text.contains(&format!("node {node}")), "{text}");
                assert!(text.contains("does not exist"), "{text}");
            }
            other => panic!("{other:?}"),
        }
        assert!(MemPolicy::Preferred(node).validate().is_ok(), "shape only");
        assert!(MemPolicy::Preferred(node).validate_here().is_err());
    }
}
