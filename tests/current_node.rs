//! `topology::current_node` and `current_cpu` against the kernel's own answer: a thread
//! pinned (`sched_setaffinity`) to each CPU it may use in turn must read that CPU, and
//! the node sysfs lists the CPU under — through whichever lookup the process chose
//! (rseq or getcpu), and through `getcpu` (the syscall, via libc) as well. On a one-node
//! host every CPU is on node 0, so the node half proves little there; the VM (4 nodes,
//! one CPU each) is where it tells nodes apart, and the test says which it was.

mod common;

use numapin::Node;
use numapin::topology::{NodeLookup, Topology, current_cpu, current_node, node_lookup};
use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

/// The kernel's answer, by the raw syscall (not the vDSO, not rseq): an independent
/// reference for both lookups.
fn getcpu_syscall() -> (usize, usize) {
    let (mut cpu, mut node) = (0u32, 0u32);
    // SAFETY: two valid out-pointers and a null cache.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &mut cpu as *mut u32,
            &mut node as *mut u32,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    assert_eq!(rc, 0, "getcpu: {}", std::io::Error::last_os_error());
    (cpu as usize, node as usize)
}

#[test]
fn a_thread_pinned_to_a_cpu_reads_that_cpus_node() {
    let allowed = sched_getaffinity(None).unwrap();
    let cpus: Vec<usize> = (0..CpuSet::MAX_CPU)
        .filter(|&c| allowed.is_set(c))
        .collect();
    assert!(!cpus.is_empty());
    let topology = Topology::get().unwrap();
    let lookup = node_lookup();
    let nodes_seen = std::thread::scope(|s| {
        s.spawn(|| {
            let mut seen = std::collections::BTreeSet::new();
            for &cpu in &cpus {
                let mut one = CpuSet::new();
                one.set(cpu);
                sched_setaffinity(None, &one).unwrap();
                // The kernel moves the thread before sched_setaffinity returns; rseq's
                // fields are rewritten on that return to user space.
                let expected = topology.node_of_cpu(cpu).unwrap_or(Node(0));
                assert_eq!(current_cpu(), cpu, "{lookup:?}");
                assert_eq!(current_node().unwrap(), expected, "cpu {cpu}, {lookup:?}");
                assert_eq!(getcpu_syscall(), (cpu, expected.index()), "the kernel");
                seen.insert(expected);
            }
            sched_setaffinity(None, &allowed).unwrap();
            seen
        })
        .join()
        .unwrap()
    });
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "current_node: {lookup:?}; {} CPUs on {} nodes checked{}",
        cpus.len(),
        nodes_seen.len(),
        if nodes_seen.len() < 2 {
            " (one node: CPU -> node mapping not told apart here; the VM does)"
        } else {
            ""
        }
    );
    // With NUMAPIN_TEST_NODES promising a NUMA machine (the VM), CPUs on 2+ nodes must
    // have been visited.
    if common::need_nodes("a_thread_pinned_to_a_cpu_reads_that_cpus_node", 2).is_some() {
        assert!(nodes_seen.len() >= 2, "{nodes_seen:?}");
    }
}

/// Where this box has glibc 2.35+ and Linux 6.3+, the cheap path is the one in use (a
/// regression to getcpu would show only as time otherwise). Elsewhere it says why not.
#[test]
fn rseq_is_used_where_glibc_and_the_kernel_offer_it() {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse::<u32>().ok());
    let kernel = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    // SAFETY: a NUL-terminated name.
    let glibc_rseq =
        !unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr()) }.is_null();
    let tunable_off = std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("rseq=0"));
    let expected = if kernel >= (6, 3) && glibc_rseq && !tunable_off {
        NodeLookup::Rseq
    } else {
        NodeLookup::Getcpu
    };
    assert_eq!(
        node_lookup(),
        expected,
        "kernel {}, glibc rseq {glibc_rseq}",
        release.trim()
    );
}
