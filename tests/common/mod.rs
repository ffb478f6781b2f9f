//! What the environment promises, so every test asserts the right outcome everywhere.
//!
//! `NUMAPIN_EXPECT` = `full` | `denied` | `unsupported` says what the NUMA syscalls must
//! do here (the xtask sets it for each environment); unset, the probe decides.
//! `NUMAPIN_TEST_NODES` says how many memory nodes a multi-node test may count on.
#![allow(dead_code)]

use numapin::{Errno, MempolicySupport, NodeSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    Full,
    Denied,
    Unsupported,
}

pub fn expect() -> Expect {
    match std::env::var("NUMAPIN_EXPECT").as_deref() {
        Ok("full") => Expect::Full,
        Ok("denied") => Expect::Denied,
        Ok("unsupported") => Expect::Unsupported,
        Ok(other) => panic!("NUMAPIN_EXPECT={other:?}: expected full, denied or unsupported"),
        Err(_) => match numapin::mempolicy_support().expect("probe") {
            MempolicySupport::Available => Expect::Full,
            MempolicySupport::Denied => Expect::Denied,
            MempolicySupport::Unsupported => Expect::Unsupported,
        },
    }
}

/// The errno a NUMA syscall gives here when the kernel itself would answer `full`.
pub fn errno_here(full: Errno) -> Errno {
    match expect() {
        Expect::Full => full,
        Expect::Denied => Errno::PERM,
        Expect::Unsupported => Errno::NOSYS,
    }
}

/// `Ok` where the calls work, the degradation errno elsewhere.
pub fn ok_here() -> Result<(), Errno> {
    match expect() {
        Expect::Full => Ok(()),
        Expect::Denied => Err(Errno::PERM),
        Expect::Unsupported => Err(Errno::NOSYS),
    }
}

pub fn degrade_here() -> Option<numapin::DegradeReason> {
    match expect() {
        Expect::Full => None,
        Expect::Denied => Some(numapin::DegradeReason::Denied),
        Expect::Unsupported => Some(numapin::DegradeReason::Unsupported),
    }
}

/// The memory nodes the test may use, checked against `NUMAPIN_TEST_NODES`.
pub fn nodes() -> NodeSet {
    let allowed = NodeSet::allowed().expect("allowed nodes");
    if let Ok(n) = std::env::var("NUMAPIN_TEST_NODES") {
        let n: usize = n.parse().expect("NUMAPIN_TEST_NODES is a number");
        let possible = numapin::possible_node_count();
        assert!(
            possible >= n,
            "NUMAPIN_TEST_NODES={n} but the kernel has {possible} possible nodes"
        );
    }
    allowed
}

/// For a test that needs `n` memory nodes: `Some(nodes)` when they exist; otherwise it
/// prints that it did not run (and fails if `NUMAPIN_TEST_NODES` promised them).
pub fn need_nodes(test: &str, n: usize) -> Option<NodeSet> {
    let nodes = nodes();
    if expect() == Expect::Full && nodes.len() >= n {
        return Some(nodes);
    }
    let promised = std::env::var("NUMAPIN_TEST_NODES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1);
    assert!(
        promised < 2 || expect() != Expect::Full,
        "{test}: needs {n} memory nodes; NUMAPIN_TEST_NODES={promised} promised a NUMA machine \
         but only {} memory nodes are allowed",
        nodes.len()
    );
    // Straight to the process's stderr: libtest captures `eprintln!` of passing tests,
    // and this line must be seen (the xtask counts them).
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "NOT RUN: {test} needs {n} memory nodes with placement available; here: {} nodes ({:?})",
        nodes.len(),
        expect()
    );
    None
}
