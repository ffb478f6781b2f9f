//! The calling thread's policy. Each test runs in a thread of its own, since a thread
//! policy belongs to one thread.

mod common;

use std::panic::AssertUnwindSafe;

use common::{Expect, degrade_here, expect};
use numapin::{NodeSet, policy};

use numapin::policy::{MemPolicy, ModeFlags, Observed, Placement};

fn in_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().expect("test thread")
}

#[test]
fn a_new_thread_starts_with_the_default_policy() {
    let got = in_thread(policy::thread_policy).unwrap();
    match (expect(), got) {
        (Expect::Full, Observed::Known(p)) => {
            assert_eq!(p, (MemPolicy::Default, ModeFlags::empty()))
        }
        (_, Observed::Degraded(reason)) => assert_eq!(Some(reason), degrade_here()),
        (e, other) => panic!("{e:?}: {other:?}"),
    }
}

#[test]
fn set_and_read_back() {
    in_thread(|| {
        let nodes = NodeSet::allowed().unwrap();
        for p in [
            MemPolicy::Interleave(nodes),
            MemPolicy::Bind(nodes),
            MemPolicy::Local,
            MemPolicy::Default,
        ] {
            let placement = policy::set_thread_policy(&p).unwrap();
            assert_eq!(
                placement,
                degrade_here().map_or(Placement::Bound, Placement::Degraded)
            );
            if let Observed::Known((got, _)) = policy::thread_policy().unwrap() {
                assert_eq!(got, p);
            }
        }
    });
}

#[test]
fn scoped_guard_restores_the_previous_policy() {
    in_thread(|| {
        let nodes = NodeSet::allowed().unwrap();
        let outer = MemPolicy::Bind(nodes);
        let _ = policy::set_thread_policy(&outer).unwrap();
        {
            let guard = policy::scoped(&MemPolicy::Interleave(nodes)).unwrap();
            assert_eq!(
                guard.placement(),
                degrade_here().map_or(Placement::Bound, Placement::Degraded)
            );
            if let Observed::Known((p, _)) = policy::thread_policy().unwrap() {
                assert_eq!(p, MemPolicy::Interleave(nodes));
            }
            // First-touch pages of this thread land under the scoped policy.
            let mut page = numapin::Region::anonymous_fenced(numapin::page_size()).unwrap();
            page.as_mut_slice().unwrap()[0] = 1;
            if let Some(h) = common::placement_here(page.placement().unwrap()) {
                assert!(h.pages.keys().all(|n| nodes.contains(*n)));
                common::whole(&h, 1);
                assert_eq!(h.present(), 1);
            }
        }
        if let Observed::Known((p, _)) = policy::thread_policy().unwrap() {
            assert_eq!(p, outer);
        }
    });
}

#[test]
fn scoped_guard_restores_on_panic_unwinding() {
    in_thread(|| {
        let nodes = NodeSet::allowed().unwrap();
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let _guard = policy::scoped(&MemPolicy::Interleave(nodes)).unwrap();
            panic!("unwinding through the guard");
        }));
        assert!(result.is_err());
        if let Observed::Known((p, flags)) = policy::thread_policy().unwrap() {
            assert_eq!((p, flags), (MemPolicy::Default, ModeFlags::empty()));
        }
    });
}

#[test]
fn policy_with_mode_flags_reads_back_with_them() {
    in_thread(|| {
        let nodes = NodeSet::allowed().unwrap();
        let placement =
            policy::set_thread_policy_with(&MemPolicy::Bind(nodes), ModeFlags::STATIC_NODES)
                .unwrap();
        if placement.is_bound() {
            assert_eq!(
                policy::thread_policy().unwrap(),
                Observed::Known((MemPolicy::Bind(nodes), ModeFlags::STATIC_NODES))
            );
        }
    });
}
