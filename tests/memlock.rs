//! RLIMIT_MEMLOCK is process-wide: this test binary owns it.

use numapin::{Error, Region};

#[test]
fn lock_beyond_the_limit_is_a_clear_error() {
    let page = numapin::page_size() as u64;
    std::thread::spawn(move || {
        // Capabilities are per thread: drop CAP_IPC_LOCK here so the limit applies even
        // when the suite runs as root.
        let _ = caps::drop(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_IPC_LOCK,
        );
        let limit = 16 * page;
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
