//! The probe agrees with what the environment promises.

mod common;

use common::{Expect, expect, expect_pages};
use numapin::MempolicySupport;

#[test]
fn probe_reports_the_expected_state() {
    let support = numapin::probe().unwrap();
    let want = |e| match e {
        Expect::Full => MempolicySupport::Available,
        Expect::Denied => MempolicySupport::Denied,
        Expect::Unsupported => MempolicySupport::Unsupported,
    };
    assert_eq!(support.mempolicy, want(expect()));
    assert_eq!(support.page_calls, want(expect_pages()));
    assert_eq!(
        numapin::group_support(numapin::SyscallGroup::Pages).unwrap(),
        support.page_calls
    );
    assert!(!support.allowed().is_empty());
    assert!(support.nodes_with_memory.len() <= support.possible_nodes);
    assert!(support.map_count > 0 && support.map_count < support.max_map_count);
    assert_eq!(support.allowed(), numapin::NodeSet::allowed().unwrap());
    // The report prints every section.
    let text = support.to_string();
    for key in [
        "mempolicy",
        "page calls",
        "nodes with memory",
        "max_map_count",
        "CAP_SYS_NICE",
        "THP",
    ] {
        assert!(text.contains(key), "{key} missing from:\n{text}");
    }
}

#[test]
fn parse_all_is_the_allowed_set() {
    assert_eq!(
        numapin::NodeSet::parse("all").unwrap(),
        numapin::NodeSet::allowed().unwrap()
    );
}
