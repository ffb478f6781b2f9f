//! RLIMIT_MEMLOCK is process-wide: this test binary owns it, and its one test runs the
//! cases one after the other.

use numapin::{Error, Region};

/// Whether this process is in the initial user namespace, the only one where the kernel
/// lets CAP_IPC_LOCK lift the limit.
fn in_initial_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map")
        .is_ok_and(|m| m.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"])
}

#[test]
fn lock_beyond_the_limit_is_a_clear_error() {
    let page = numapin::page_size() as u64;
    let limit = 16 * page;
    std::thread::spawn(move || {
        set_memlock_limit(limit);
        // With whatever capabilities this thread has: CAP_IPC_LOCK lifts the limit only
        // in the initial user namespace. Inside `unshare -U -r` (the container stage) the
        // namespace's own CAP_IPC_LOCK is effective but the kernel ignores it: this used
        // to be a bare `mlock ENOMEM`.
        let lifted = in_initial_user_namespace()
            && caps::has_cap(
                None,
                caps::CapSet::Effective,
                caps::Capability::CAP_IPC_LOCK,
            )
            .unwrap();
        let big = Region::anonymous(64 * page as usize).unwrap();
        match (lifted, big.lock()) {
            (true, Ok(())) => big.unlock().unwrap(),
            (
                false,
                Err(Error::MemlockLimit {
                    wanted, limit: l, ..
                }),
            ) => {
                assert_eq!((wanted, l), (64 * page, limit))
            }
            (lifted, other) => panic!("CAP_IPC_LOCK lifts the limit: {lifted}; {other:?}"),
        }
    })
    .join()
    .unwrap();
    std::thread::spawn(move || {
        // Capabilities are per thread: drop CAP_IPC_LOCK here so the limit applies even
        // when the suite runs as root.
        let _ = caps::drop(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_IPC_LOCK,
        );
        let small = Region::anonymous(4 * page as usize).unwrap();
        small.lock().unwrap();
        let big = Region::anonymous(64 * page as usize).unwrap();
        match big.lock() {
            Err(Error::MemlockLimit {
                wanted,
                locked,
                limit: l,
            }) => {
                assert_eq!((wanted, l), (64 * page, limit));
                assert!(locked >= 4 * page, "locked {locked}");
                let text = big.lock().unwrap_err().to_string();
                assert!(
                    text.contains("RLIMIT_MEMLOCK") && text.contains(&limit.to_string()),
                    "{text}"
                );
            }
            other => panic!("{other:?}"),
        }
        small.unlock().unwrap();
    })
    .join()
    .unwrap();
}

fn set_memlock_limit(limit: u64) {
    rustix::process::setrlimit(
        rustix::process::Resource::Memlock,
        rustix::process::Rlimit {
            current: Some(limit),
            maximum: None,
        },
    )
    .or_else(|_| {
        let hard = rustix::process::getrlimit(rustix::process::Resource::Memlock).maximum;
        rustix::process::setrlimit(
            rustix::process::Resource::Memlock,
            rustix::process::Rlimit {
                current: Some(limit),
                maximum: hard,
            },
        )
    })
    .unwrap();
}
