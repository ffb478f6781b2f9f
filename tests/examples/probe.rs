//! `probe`: the support report in aligned columns, the verdict on what placement does
//! here, and its JSON: the schema, the support and the verdict, in the form the
//! library's `serde` feature gives `Support`.

use super::set;

use super::common::{self, expect};
use numapin::{MempolicySupport, Node, Support, ThpMode};

use super::support::report::{PROBE_SCHEMA, ProbeJson, verdict};

fn support(
    mempolicy: MempolicySupport,
    page_calls: MempolicySupport,
    memory: &[usize],
    allowed: &[usize],
) -> Support {
    Support {
        mempolicy,
        page_calls,
        possible_nodes: 4,
        nodes_with_memory: set(memory),
        nodes_with_cpus: set(&memory[..1]),
        mems_allowed: set(allowed),
        distances: Vec::new(),
        free_bytes: Vec::new(),
        numa_balancing: None,
        thp: ThpMode::Never,
        max_map_count: 65530,
        map_count: 40,
        cap_sys_nice: false,
        populate_write: true,
        anon_vma_names: false,
    }
}

/// A four-node machine: distances of two and three digits, free memory of several widths.
fn four_nodes() -> Support {
    use MempolicySupport::Available;
    let mut s = support(Available, Available, &[0, 1, 2, 3], &[0, 1, 2, 3]);
    s.distances = vec![
        (Node(0), vec![10, 21, 31, 120]),
        (Node(1), vec![21, 10, 21, 31]),
        (Node(2), vec![31, 21, 10, 21]),
        (Node(3), vec![120, 31, 21, 10]),
    ];
    s.free_bytes = vec![
        (Node(0), 3 << 30),
        (Node(1), 120 << 30),
        (Node(2), 1 << 29),
        (Node(3), 0),
    ];
    s.numa_balancing = Some(1);
    s.thp = ThpMode::Madvise;
    s
}

#[test]
fn the_verdict_says_what_placement_does_here() {
    use MempolicySupport::{Available, Denied, Unsupported};
    let cases = [
        (
            support(Available, Available, &[0], &[0]),
            "one memory node: placement is a no-op here",
        ),
        (
            support(Available, Available, &[0, 1, 2, 3], &[0, 1, 2, 3]),
            "placement works on nodes 0-3",
        ),
        (
            support(Available, Available, &[0, 1, 2, 3], &[2]),
            "one allowed memory node (2 of 0-3): placement is a no-op here",
        ),
        (
            support(Available, Denied, &[0, 1, 2, 3], &[0, 1, 2, 3]),
            "placement works on nodes 0-3; page calls denied (EPERM): placement proven \
             through numa_maps",
        ),
        (
            support(Denied, Denied, &[0, 1, 2, 3], &[0, 1, 2, 3]),
            "NUMA calls denied (EPERM): running unplaced",
        ),
        (
            support(Unsupported, Unsupported, &[0], &[0]),
            "kernel without NUMA (ENOSYS): running unplaced",
        ),
    ];
    for (support, want) in cases {
        assert_eq!(verdict(&support), want, "{support:?}");
    }
}

/// Checks that every line of a `Support` report starts its value in one column, and
/// that the distance table's columns end in the same places on every row.
fn assert_aligned(text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    let first = lines[0];
    let column = first.len() - first[first.find(' ').unwrap()..].trim_start().len();
    for line in &lines {
        assert!(line.len() > column, "{line:?} in:\n{text}");
        assert_eq!(&line[column - 1..column], " ", "{line:?} in:\n{text}");
        assert!(
            !line[..column].trim_end().contains("  "),
            "{line:?} in:\n{text}"
        );
        assert!(
            !line[..column].trim_end().is_empty(),
            "{line:?} in:\n{text}"
        );
    }
    let ends = |line: &str| -> Vec<usize> {
        let mut ends = Vec::new();
        let bytes = line.as_bytes();
        for i in column..line.len() {
            if bytes[i] != b' ' && (i + 1 == line.len() || bytes[i + 1] == b' ') {
                ends.push(i);
            }
        }
        ends
    };
    let table: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("distance"))
        .collect();
    for line in &table {
        assert_eq!(ends(line), ends(table[0]), "{line:?} in:\n{text}");
    }
    let free: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("free on node"))
        .collect();
    for line in &free {
        assert_eq!(line.len(), free[0].len(), "{line:?} in:\n{text}");
    }
}

#[test]
fn the_support_report_is_in_columns() {
    let machine = four_nodes();
    let text = machine.to_string();
    assert_aligned(&text);
    // A header of node ids over a row per node.
    assert_eq!(
        text.lines().filter(|l| l.starts_with("distance")).count(),
        machine.distances.len() + 1,
        "{text}"
    );
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("free on node"))
            .count(),
        machine.free_bytes.len(),
        "{text}"
    );
    assert_aligned(&numapin::probe().unwrap().to_string());
}

fn state_word(state: MempolicySupport) -> &'static str {
    match state {
        MempolicySupport::Available => "available",
        MempolicySupport::Denied => "denied",
        MempolicySupport::Unsupported => "unsupported",
    }
}

#[test]
fn probe_json_has_the_schema_the_support_and_the_verdict() {
    let here = numapin::probe().unwrap();
    let value = serde_json::to_value(ProbeJson::new(&here)).unwrap();
    assert_eq!(value["schema"], PROBE_SCHEMA);
    assert_eq!(value["verdict"], verdict(&here));
    assert_eq!(value["allowed"], here.allowed().to_string());
    let want = match expect() {
        common::Expect::Full => MempolicySupport::Available,
        common::Expect::Denied => MempolicySupport::Denied,
        common::Expect::Unsupported => MempolicySupport::Unsupported,
    };
    assert_eq!(value["support"]["mempolicy"], state_word(want));
    assert_eq!(value["support"]["page_calls"], state_word(here.page_calls));

    let machine = four_nodes();
    let value = serde_json::to_value(ProbeJson::new(&machine)).unwrap();
    assert_eq!(value["allowed"], "0-3");
    assert_eq!(value["support"]["thp"], "madvise");
    assert_eq!(
        value["support"]["distances"][3],
        serde_json::json!([3, machine.distances[3].1])
    );
    assert_eq!(
        value["support"]["free_bytes"][1],
        serde_json::json!([1, machine.free_bytes[1].1])
    );
}

/// The example builds its JSON without the library's `serde` feature; where the feature
/// is on, the two must be the same document, and it must read back as the `Support`.
#[cfg(feature = "serde")]
#[test]
fn probe_json_is_supports_serde_form() {
    use MempolicySupport::{Available, Denied, Unsupported};
    let mut machines = vec![
        numapin::probe().unwrap(),
        four_nodes(),
        support(Denied, Denied, &[0], &[0]),
        support(Unsupported, Unsupported, &[0], &[0]),
        support(Available, Denied, &[0, 1], &[1]),
    ];
    machines[2].thp = ThpMode::Always;
    machines[3].thp = ThpMode::Unknown;
    machines[3].nodes_with_cpus = numapin::NodeSet::new();
    for machine in machines {
        let example = serde_json::to_value(ProbeJson::new(&machine)).unwrap();
        let library = serde_json::to_value(&machine).unwrap();
        assert_eq!(example["support"], library, "{machine:?}");
        let back: Support = serde_json::from_value(example["support"].clone()).unwrap();
        assert_eq!(back, machine);
    }
}
