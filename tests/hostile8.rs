//! Round 5's hostile pass over issue 31's merge: each test failed before its fix.
#![cfg(feature = "model")]

use numapin::model::{ExpertShare, PlacementPlan, TensorSlice};
use numapin::{Error, NodeSet};

/// Each parser names what it parses: an expert share, a tensor slice or a rank that does
/// not parse is not an "invalid node string" (they all reused the node parser's variant and
/// its words before).
#[test]
fn each_parser_names_what_it_parses() {
    let cases: [(&str, Result<(), Error>, &str); 5] = [
        ("share", ExpertShare::parse("x-y").map(drop), "expert share"),
        (
            "share zz",
            ExpertShare::parse("zz").map(drop),
            "expert share",
        ),
        (
            "slice",
            TensorSlice::parse("diagonal:0/2").map(drop),
            "tensor slice",
        ),
        (
            "rank",
            PlacementPlan::parse_rank("one/two").map(drop),
            "rank",
        ),
        ("nodes", NodeSet::parse("zero").map(drop), "node string"),
    ];
    for (case, result, name) in cases {
        let e = result.expect_err(case);
        assert!(matches!(e, Error::Parse { .. }), "{case}: {e:?}");
        let message = e.to_string();
        assert!(message.contains(name), "{case}: {name:?} not in {message}");
        if case != "nodes" {
            assert!(!message.contains("node string"), "{case}: {message}");
        }
    }
}

fn machine_json(n: usize) -> String {
    let nodes: Vec<String> = (0..n)
        .map(|i| {
            format!(
                r#"{{"id":{i},"domain":{},"free_bytes":1099511627776}}"#,
                i / 2
            )
        })
        .collect();
    format!(r#"{{"numapin_topology":1,"nodes":[{}]}}"#, nodes.join(","))
}

/// A key given twice in a description: serde_json's map keeps the last and drops the
/// first without a word, so a file whose second `layers` (or `nodes`, or a node's `id`)
/// differs from its first was read as another file.
#[test]
fn a_description_key_given_twice_is_refused_by_name() {
    use numapin::planner::Machine;
    use numapin::routing::RoutingStats;
    let routing = [
        r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[1,2]}],"layers":[{"layer":2,"counts":[3]}]}"#,
        r#"{"numapin_routing":1,"layers":[{"layer":1,"layer":2,"counts":[1,2]}]}"#,
        r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[1,2],"counts":[5]}]}"#,
        r#"{"numapin_routing":1,"numapin_routing":1,"layers":[]}"#,
    ];
    for text in routing {
        let e = RoutingStats::from_json(text).expect_err(text).to_string();
        assert!(e.contains("twice"), "{text}: {e}");
    }
    let machine = [
        r#"{"numapin_topology":1,"nodes":[{"id":0,"free_bytes":1}],"nodes":[{"id":1,"free_bytes":1}]}"#,
        r#"{"numapin_topology":1,"nodes":[{"id":0,"id":1,"free_bytes":1}]}"#,
        r#"{"numapin_topology":1,"nodes":[{"id":0,"free_bytes":1,"free_bytes":9}]}"#,
    ];
    for text in machine {
        let e = Machine::from_json(text).expect_err(text).to_string();
        assert!(e.contains("twice"), "{text}: {e}");
    }
    // A megabyte-long key given twice is named clipped.
    let key = "k".repeat(1 << 20);
    let text = format!(r#"{{"numapin_routing":1,"layers":[],"{key}":1,"{key}":2}}"#);
    let e = RoutingStats::from_json(&text).unwrap_err().to_string();
    assert!(e.contains("twice") && e.len() < 2000, "{}", e.len());
    // Keys that differ only by escapes are the same key.
    let e = RoutingStats::from_json(r#"{"numapin_routing":1,"layers":[],"l\u0061yers":[]}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("twice"), "{e}");
}

/// The planner and `balance` with 65,536 experts (the crate's ceiling per layer) and
/// degenerate statistics: all zero, all `u64::MAX`, one expert with every token,
/// alternating extremes. Each finishes (debug and release) with every expert placed
/// once, no node past its cap, and the loads summed without wrapping.
#[test]
fn the_ceiling_with_degenerate_statistics() {
    use numapin::planner::{self, Machine, ModelSizes, MoeLayerSizes, PlanOptions};
    use numapin::routing::{RoutingStats, balance, node_loads};
    const E: usize = 65_536;
    let shapes: [(&str, Vec<u64>); 4] = [
        ("zero", vec![0; E]),
        ("max", vec![u64::MAX; E]),
        (
            "one hot",
            (0..E).map(|e| u64::from(e == 777) * u64::MAX).collect(),
        ),
        (
            "alternating",
            (0..E)
                .map(|e| if e % 2 == 0 { u64::MAX } else { 0 })
                .collect(),
        ),
    ];
    let machine = Machine::from_json(&machine_json(4)).unwrap();
    let sizes = ModelSizes {
        moe_layers: vec![MoeLayerSizes {
            layer: 0,
            experts: E,
            weight_bytes: 4096,
            scale_bytes: 0,
        }],
        other_bytes: 1 << 20,
    };
    for (name, counts) in &shapes {
        for caps in [vec![E / 4; 4], vec![E; 4], vec![E - 3, 1, 1, 1]] {
            let a = balance(counts, &caps).unwrap();
            assert_eq!(a.len(), E, "{name}");
            let mut used = vec![0usize; caps.len()];
            for &n in &a {
                used[n] += 1;
            }
            assert!(
                used.iter().zip(&caps).all(|(u, c)| u <= c),
                "{name}: {used:?}"
            );
            let loads = node_loads(counts, &a, caps.len());
            let total: u128 = counts.iter().map(|&c| u128::from(c)).sum();
            assert_eq!(loads.iter().sum::<u128>(), total, "{name}");
        }
        let stats = RoutingStats::from_counts([(0, counts.clone())]).unwrap();
        let table = planner::plan(&sizes, &machine, Some(&stats), &PlanOptions::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for row in &table.rows {
            for f in [
                row.remote_fraction,
                row.cross_domain_fraction,
                row.mean_distance,
                row.imbalance,
                row.hot_traffic,
            ] {
                assert!(f.is_finite(), "{name}: {:?} {f}", row.candidate);
            }
        }
    }
}

/// A safetensors file of one U8 tensor `name` of `n` bytes (`i * 7 + 1` each).
fn write_one(path: &std::path::Path, name: &str, n: usize) {
    let header = format!(r#"{{"{name}":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#);
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.extend((0..n).map(|i| (i as u8).wrapping_mul(7).wrapping_add(1)));
    std::fs::write(path, file).unwrap();
}

/// A safetensors file of U8 tensors (name, bytes), each byte `i * 7 + 1`.
fn write_many(path: &std::path::Path, tensors: &[(String, usize)]) {
    let mut at = 0;
    let entries: Vec<String> = tensors
        .iter()
        .map(|(name, n)| {
            at += n;
            format!(
                r#""{name}":{{"dtype":"U8","shape":[{n}],"data_offsets":[{},{at}]}}"#,
                at - n
            )
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.extend((0..at).map(|i| (i as u8).wrapping_mul(7).wrapping_add(1)));
    std::fs::write(path, file).unwrap();
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("numapin-hostile8-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A tensor given twice in the index's `weight_map` (first with the shard that holds it,
/// then with one that does not, or the other way round): the map kept the last without a
/// word. Refused by name, as a name twice in a header is.
#[test]
fn an_index_naming_a_tensor_twice_is_refused() {
    use numapin::model::Checkpoint;
    let dir = scratch("index-twice");
    write_one(&dir.join("a.safetensors"), "t", 8);
    write_one(&dir.join("b.safetensors"), "u", 8);
    for map in [
        r#"{"t":"b.safetensors","t":"a.safetensors","u":"b.safetensors"}"#,
        r#"{"t":"a.safetensors","u":"b.safetensors","t":"a.safetensors"}"#,
    ] {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            format!(r#"{{"weight_map":{map}}}"#),
        )
        .unwrap();
        let e = Checkpoint::open(&dir).expect_err(map).to_string();
        assert!(e.contains("twice"), "{map}: {e}");
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map":{"t":"a.safetensors","u":"b.safetensors"}}"#,
    )
    .unwrap();
    assert!(Checkpoint::open(&dir).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint truncated by another process after it was opened (the headers read, the
/// data gone): the reads are `pread`s into the slots, no mapping of the file, so it was
/// never a SIGBUS, but the error named neither the file nor the tensor ("layer 0 expert 0
/// weights: piece at file offsets 97..1048673 runs past the end of the file" for a dense
/// tensor). Now `Truncated` naming the file and both lengths, for `place` and `pack`.
/// Held: a placement whose file is truncated afterwards does not verify.
#[test]
fn a_checkpoint_truncated_under_the_placement_is_a_clean_error() {
    use numapin::model::{Checkpoint, DenseLayout, PlacementPlan};
    use numapin::store::{Layout, StoreOptions};
    let dir = scratch("truncated");
    let path = dir.join("model.safetensors");
    write_one(&path, "model.embed_tokens.weight", 1 << 20);
    let all = NodeSet::allowed().unwrap();
    let plan = PlacementPlan::new(Layout::SplitExperts(all), DenseLayout::Replicate(all));
    let header = std::fs::metadata(&path).unwrap().len() - (1 << 20);
    for keep in [header + 4096, header, 0] {
        write_one(&path, "model.embed_tokens.weight", 1 << 20);
        let checkpoint = Checkpoint::open(&path).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(keep)
            .unwrap();
        let e = checkpoint
            .place(&plan, StoreOptions::default())
            .map(drop)
            .expect_err("placed from a truncated file")
            .to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("truncated since"),
            "{keep}: {e}"
        );
    }
    // The experts' path (Checkpoint::pack) alike.
    let moe = dir.join("moe.safetensors");
    let experts: Vec<(String, usize)> = ["gate_proj", "up_proj", "down_proj"]
        .iter()
        .flat_map(|role| {
            (0..2).map(move |e| {
                (
                    format!("model.layers.0.mlp.experts.{e}.{role}.weight"),
                    4096,
                )
            })
        })
        .collect();
    write_many(&moe, &experts);
    let checkpoint = Checkpoint::open(&moe).unwrap();
    let len = std::fs::metadata(&moe).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&moe)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let store =
        numapin::store::PinStore::new(Layout::SplitExperts(all), StoreOptions::default()).unwrap();
    let e = checkpoint.pack(&store).map(drop).unwrap_err().to_string();
    assert!(
        e.contains("moe.safetensors") && e.contains("truncated since"),
        "{e}"
    );
    write_one(&path, "model.embed_tokens.weight", 1 << 20);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let model = checkpoint.place(&plan, StoreOptions::default()).unwrap();
    assert!(model.verify(&checkpoint).unwrap().verified());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(header + 100)
        .unwrap();
    match model.verify(&checkpoint) {
        Ok(v) => assert!(!v.verified(), "a truncated file verified"),
        Err(e) => assert!(e.to_string().contains("model.safetensors"), "{e}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bug (fixed): a share of 65,536 single experts (`0,2,4,…,131070`, 400 KB of text)
/// resolved against a smaller layer named the whole share in its `OutOfRange` (a
/// 382,000-byte message). Held: overlapping ranges are refused by name (the cpulist shape
/// of item 7 cannot pile up), a range to `usize::MAX` and 65,536 single experts resolve
/// to what they name.
#[test]
fn share_texts_at_the_edges() {
    let repeated = vec!["0-1048575"; 2000].join(",");
    let e = ExpertShare::parse(&repeated).unwrap_err().to_string();
    assert!(e.contains("overlapping") && e.len() < 2000, "{}", e.len());
    let even: Vec<String> = (0..65_536).map(|e| (2 * e).to_string()).collect();
    let share = ExpertShare::parse(&even.join(",")).unwrap();
    assert_eq!(share.resolve(0, 65_536).map(|v| v.len()).ok(), None);
    for experts in [8, 65_536] {
        let e = share.resolve(3, experts).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.len() < 2000 && e.contains("layer 3"), "{}", e.len());
    }
    let all: Vec<String> = (0..65_536).map(|e| e.to_string()).collect();
    let held = ExpertShare::parse(&all.join(","))
        .unwrap()
        .resolve(0, 65_536)
        .unwrap();
    assert_eq!(held, (0..65_536).collect::<Vec<_>>());
    let e = ExpertShare::parse("0-18446744073709551614")
        .unwrap()
        .resolve(0, 8)
        .unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e:?}");
}

/// Held: the planner with figures at the edges of `u64` — every node's free memory
/// `u64::MAX` on 1,024 nodes, experts and non-expert bytes of `u64::MAX`, a budget of
/// `u64::MAX` or 1 — gives a table or an error naming the overflow, never a panic (an
/// overflow panics in a debug build: this test runs there).
#[test]
fn the_planner_at_the_edges_of_u64() {
    use numapin::planner::{self, Machine, ModelSizes, MoeLayerSizes, PlanOptions};
    use numapin::routing::RoutingStats;
    let nodes: Vec<String> = (0..1024)
        .map(|i| {
            format!(
                r#"{{"id":{i},"domain":{},"free_bytes":18446744073709551615}}"#,
                i / 4
            )
        })
        .collect();
    let machine = Machine::from_json(&format!(
        r#"{{"numapin_topology":1,"nodes":[{}],"max_map_count":18446744073709551615}}"#,
        nodes.join(",")
    ))
    .unwrap();
    let small = Machine::from_json(&machine_json(2)).unwrap();
    let stats = RoutingStats::from_counts([(0, vec![u64::MAX; 256]), (1, vec![1; 256])]).unwrap();
    for (weight, scale, other) in [
        (u64::MAX, u64::MAX, u64::MAX),
        (u64::MAX, 0, 0),
        (1, 1, u64::MAX),
        (u64::MAX / 256, u64::MAX / 256, 1),
    ] {
        let sizes = ModelSizes {
            moe_layers: (0..2)
                .map(|layer| MoeLayerSizes {
                    layer,
                    experts: 256,
                    weight_bytes: weight,
                    scale_bytes: scale,
                })
                .collect(),
            other_bytes: other,
        };
        for m in [&machine, &small] {
            for options in [
                PlanOptions::default(),
                PlanOptions::default().budget(u64::MAX),
                PlanOptions::default().budget(1),
            ] {
                for s in [None, Some(&stats)] {
                    if let Ok(table) = planner::plan(&sizes, m, s, &options) {
                        let _ = table.to_json();
                    }
                }
            }
        }
    }
}

/// Held: tensor slices at the edges of `u64` (a start or a length of 2^64 - 1, a part
/// of 2^64 - 1 parts, an F4 tensor cut by columns) applied to a checkpoint's tensors
/// by pattern are a placement or an error naming the slice, never a panic (a debug
/// build checks every overflow); where they place, the bytes are the file's cut.
#[test]
fn slices_at_the_edges_of_u64() {
    use numapin::model::{Checkpoint, DenseLayout, PlacementPlan};
    use numapin::store::{Layout, StoreOptions};
    let dir = scratch("slices");
    let path = dir.join("model.safetensors");
    write_many(
        &path,
        &[
            ("model.embed_tokens.weight".to_owned(), 32),
            ("model.norm.weight".to_owned(), 1),
        ],
    );
    let checkpoint = Checkpoint::open(&path).unwrap();
    let all = NodeSet::allowed().unwrap();
    let max = u64::MAX;
    for text in [
        format!("rows:{max}:1"),
        format!("rows:0:{max}"),
        format!("rows:{max}:{max}"),
        format!("columns:{max}:1"),
        format!("rows:{}/{max}", max - 1),
        format!("columns:0/{max}"),
        "rows:0/1".to_owned(),
        "rows:31:1".to_owned(),
        "rows:32:1".to_owned(),
    ] {
        let Ok(slice) = TensorSlice::parse(&text) else {
            continue;
        };
        let plan = PlacementPlan::new(Layout::SplitExperts(all), DenseLayout::Replicate(all))
            .slice_pattern("*", slice);
        let _ = checkpoint.placement_cost(&plan, &StoreOptions::default());
        if let Ok(model) = checkpoint.place(&plan, StoreOptions::default()) {
            assert!(model.verify(&checkpoint).unwrap().verified(), "{text}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
