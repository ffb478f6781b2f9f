//! Routing statistics, expert assignments and shares, fed what a hostile user would feed
//! them: deep or malformed routing JSON, assignments that name far nodes or no experts,
//! shares that overlap, nest or run past the experts.

use numapin::Error;
use numapin::model::{ExpertShare, TensorSlice};
use numapin::routing::RoutingStats;
use numapin::store::Layout;

/// Held: routing statistics that are hostile JSON — nesting far past serde's recursion
/// limit, floats, strings, negatives, a layer past `usize`, a 100k-entry layer, sums
/// past `u64::MAX` across duplicate entries — are errors naming what, never a panic or
/// a wrap; `ExpertAssignment::balanced` and `hybrid` with 0 nodes or every expert hot.
#[test]
fn hostile_routing_json_and_assignments() {
    use numapin::store::{ExpertAssignment, Home};
    let deep = format!(
        r#"{{"numapin_routing":1,"layers":{}1{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(RoutingStats::from_json(&deep).is_err());
    for (bad, says) in [
        (
            r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[1e3]}]}"#,
            "expert 0",
        ),
        (
            r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[1,null]}]}"#,
            "expert 1",
        ),
        (
            r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[[1]]}]}"#,
            "expert 0",
        ),
        (
            r#"{"numapin_routing":1,"layers":[{"layer":1.0,"counts":[1]}]}"#,
            "layer",
        ),
        (
            r#"{"numapin_routing":1,"layers":[{"layer":"1","counts":[1]}]}"#,
            "layer",
        ),
        (
            r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[]}]}"#,
            "layer 1",
        ),
        (r#"{"numapin_routing":1.0,"layers":[]}"#, "version"),
        (r#"{"numapin_routing":1,"layers":{"layer":1}}"#, "an array"),
        (
            r#"{"numapin_routing":1,"layers":[{"layer":2,"counts":[9223372036854775808]},
               {"layer":2,"counts":[9223372036854775808]}]}"#,
            "layer 2 expert 0",
        ),
    ] {
        let e = RoutingStats::from_json(bad).unwrap_err().to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
    let many: Vec<String> = (0..100_000).map(|i| (i % 7).to_string()).collect();
    let big = format!(
        r#"{{"numapin_routing":1,"layers":[{{"layer":3,"counts":[{}]}}]}}"#,
        many.join(",")
    );
    let stats = RoutingStats::from_json(&big).unwrap();
    assert_eq!(stats.layer(3).unwrap().len(), 100_000);
    // Against a model whose layer 3 has 256 experts: a mismatch, named.
    let e = stats.check_against(&[(3, 256)]).unwrap_err().to_string();
    assert!(e.contains("layer 3"), "{e}");

    let stats = RoutingStats::from_counts([(0, vec![5u64, 1, 1, 9])]).unwrap();
    let none = numapin::NodeSet::new();
    assert!(ExpertAssignment::balanced(&stats, &[(0, 4)], &none).is_err());
    let two = numapin::NodeSet::from_nodes([0, 1]).unwrap();
    let all_hot = ExpertAssignment::hybrid(&stats, &[(0, 4)], &two, usize::MAX).unwrap();
    assert_eq!(all_hot.layers().next().unwrap().1, &[Home::Hot; 4]);
    let none_hot = ExpertAssignment::hybrid(&stats, &[(0, 4)], &two, 0).unwrap();
    let homes = none_hot.layers().next().unwrap().1.to_vec();
    let on_0 = homes.iter().filter(|&&h| h == Home::Node(numapin::Node(0)));
    assert_eq!(on_0.count(), 2, "{homes:?}");
    // Equal counts: the same placement twice.
    let equal = RoutingStats::from_counts([(0, vec![4u64; 4])]).unwrap();
    assert_eq!(
        ExpertAssignment::hybrid(&equal, &[(0, 4)], &two, 1).unwrap(),
        ExpertAssignment::hybrid(&equal, &[(0, 4)], &two, 1).unwrap()
    );
}

/// Held: an assignment whose every expert is hot on a one-node split packs and reads
/// each expert back (the sources are the reference); a home outside the set (node
/// `u16::MAX`) is a named error; a layer assigned twice keeps the last assignment.
#[test]
fn hostile_assignments_pack_or_fail_by_name() {
    use numapin::store::{ExpertAssignment, ExpertSource, Home, LayerSpec, PinStore, StoreOptions};
    let set = numapin::NodeSet::allowed().unwrap();
    let first = set.iter().next().unwrap();
    let one = std::iter::once(first).collect();
    let data: Vec<Vec<u8>> = (0..4)
        .map(|e| (0..8192).map(|i| (e * 13 + i % 241) as u8).collect())
        .collect();
    let sources: Vec<ExpertSource<'_>> = data
        .iter()
        .map(|w| ExpertSource::Memory {
            weights: w,
            scales: &[],
        })
        .collect();
    let spec = LayerSpec {
        experts: 4,
        weight_bytes: 8192,
        scale_bytes: 0,
    };
    let options = |a: ExpertAssignment| {
        StoreOptions::default()
            .huge_pages(false)
            .loader_threads(2)
            .assignment(Some(a))
    };
    let hot = ExpertAssignment::new()
        .layer(0, vec![Home::Node(first); 2])
        .layer(0, vec![Home::Hot; 4]);
    let store = PinStore::new(Layout::SplitExperts(one), options(hot)).unwrap();
    store.pack_layer(0, &spec, &sources).unwrap();
    for (e, want) in data.iter().enumerate() {
        assert_eq!(store.weights(0, e).unwrap(), &want[..]);
        assert_eq!(store.home_node(0, e).unwrap(), None, "hot: no single home");
    }
    let (h, far) = (Home::Node(first), Home::Node(numapin::Node(u16::MAX)));
    let bad = ExpertAssignment::new().layer(0, vec![h, h, far, h]);
    let store = PinStore::new(Layout::SplitExperts(one), options(bad)).unwrap();
    let e = store
        .pack_layer(0, &spec, &sources)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expert 2"), "{e}");
    let empty = ExpertAssignment::new().layer(0, vec![]);
    let store = PinStore::new(Layout::SplitExperts(one), options(empty)).unwrap();
    assert!(store.pack_layer(0, &spec, &sources).is_err());
}

/// Held: shares at the edges — a per-layer function answering ids past the layer, an
/// error of its own, nothing, or another per-layer share; `k/n` with `n` past the
/// experts; a slice of 0 length; `k/n` with `n` past the axis.
#[test]
fn hostile_shares_are_named_errors() {
    let past =
        ExpertShare::per_layer(|layer, experts| ExpertShare::range(experts..experts + layer + 1));
    let e = past.resolve(3, 8).unwrap_err().to_string();
    assert!(e.contains("layer 3"), "{e}");
    let own = ExpertShare::per_layer(|layer, _| {
        Err(Error::Parse {
            what: "expert share",
            input: format!("layer {layer}"),
            part: "x".into(),
            reason: "the function's own".into(),
        })
    });
    assert!(
        own.resolve(1, 8)
            .unwrap_err()
            .to_string()
            .contains("the function's own")
    );
    let nested =
        ExpertShare::per_layer(|_, _| Ok(ExpertShare::per_layer(|_, _| Ok(ExpertShare::all()))));
    assert!(nested.resolve(0, 8).is_err());
    // Different experts per layer, overlapping across layers: each layer its own.
    let eplb = ExpertShare::per_layer(|layer, _| ExpertShare::list([layer % 4, 7]));
    assert_eq!(eplb.resolve(1, 8).unwrap(), vec![1, 7]);
    assert_eq!(eplb.resolve(5, 8).unwrap(), vec![1, 7]);
    assert!(
        ExpertShare::part(7, 16).unwrap().resolve(0, 8).is_err(),
        "nothing held"
    );
    assert_eq!(
        ExpertShare::part(14, 16).unwrap().resolve(0, 8).unwrap(),
        vec![7]
    );
    assert!(ExpertShare::part(15, 16).unwrap().resolve(0, 8).is_err());
    assert!(ExpertShare::parse("0-3,2-5").is_err(), "overlap");
    assert!(ExpertShare::parse(&format!("0-{}", usize::MAX)).is_err());
    assert!(TensorSlice::parse("rows:5:0").is_err(), "0 length");
    assert!(
        TensorSlice::parse("rows:18446744073709551615:1").is_err(),
        "overflow"
    );
    let s = TensorSlice::parse("rows:3/8").unwrap();
    assert!(s.resolve(4).unwrap_err().contains("does not divide"));
    assert!(s.resolve(0).is_err());
    assert_eq!(s.resolve(16).unwrap(), 6..8);
}
