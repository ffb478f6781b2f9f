//! A framework's plan as a rank's share (issue 33, item 1): transformers' `tp_plan`
//! vocabulary read as JSON, each rank's dense tensors cut as the style says (numpy's
//! own cut of the fixture's tensors, `tensors.json`), the routed experts held whole
//! under an expert share, and the plan's bad inputs refused by name before anything is
//! reserved.
#![cfg(feature = "model")]

mod common;

use common::{fixtures, numpy_tensors, open_fixture};

use numapin::model::{Checkpoint, DenseLayout, ExpertShare, FrameworkPlan, PlacementPlan, Share};
use numapin::store::{Layout, StoreOptions};
use numapin::{Error, Invalid, NodeSet};

const PLAN: &str = r#"{
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.input_layernorm": "replicate",
    "lm_head": "colwise_rep"
}"#;

fn base(checkpoint_all: NodeSet) -> PlacementPlan {
    PlacementPlan::new(
        Layout::SplitExperts(checkpoint_all),
        DenseLayout::Replicate(checkpoint_all),
    )
}

/// numpy's `k`-th of `n` rows (`rows`) or columns of a row-major `[a, b]` array.
fn cut(bytes: &[u8], shape: &[u64], rows: bool, k: usize, n: usize) -> Vec<u8> {
    let outer = shape[0] as usize;
    let row = bytes.len() / outer;
    if rows {
        let part = bytes.len() / n;
        return bytes[k * part..(k + 1) * part].to_vec();
    }
    let part = row / n;
    (0..outer)
        .flat_map(|r| bytes[r * row + k * part..r * row + (k + 1) * part].to_vec())
        .collect()
}

#[test]
fn each_rank_holds_the_styles_cut_and_its_experts_whole() {
    let Some(dir) = fixtures("each_rank_holds_the_styles_cut_and_its_experts_whole") else {
        return;
    };
    let all = NodeSet::parse("all").unwrap();
    let checkpoint = open_fixture(&dir, "st-sharded");
    let want = numpy_tensors(&dir.join("st-sharded"));
    // `lm_head` names no tensor here: a glob with a known style that matches nothing is
    // no error (a plan is written for a model class, not a checkpoint).
    // Under EP the plan's styles for the routed experts (transformers' EP plan writes
    // `grouped_gemm`) leave the held experts whole.
    let plan = PLAN.replace("colwise_rep", "colwise").replace(
        "\"lm_head\"",
        "\"layers.*.mlp.experts.*.gate_proj\": \"grouped_gemm\", \"lm_head\"",
    );
    let framework = FrameworkPlan::from_json(&plan).unwrap();
    for k in 0..2u64 {
        let share = Share::default().experts(ExpertShare::parse(&format!("{k}/2")).unwrap());
        let plan = framework
            .share(&checkpoint, base(all).share(share), k, 2)
            .unwrap();
        let model = checkpoint
            .place(&plan, StoreOptions::default().loader_threads(2))
            .unwrap();
        assert!(model.verify(&checkpoint).unwrap().verified());
        let (mut rows, mut columns, mut whole, mut experts) = (0, 0, 0, 0);
        for (name, shape, bytes) in &want {
            let expect = if name.contains(".experts.") {
                let expert: usize = name.split('.').nth(5).unwrap().parse().unwrap();
                if expert / 2 != k as usize {
                    assert!(model.tensor(name).is_err(), "{name}: not held by rank {k}");
                    continue;
                }
                experts += 1;
                bytes.clone()
            } else if name.contains("q_proj")
                || name.contains("gate_proj")
                || name.contains("embed_tokens")
            {
                rows += 1;
                cut(bytes, shape, true, k as usize, 2)
            } else if name.contains("o_proj") {
                columns += 1;
                cut(bytes, shape, false, k as usize, 2)
            } else {
                whole += 1;
                bytes.clone()
            };
            let got = model.tensor(name).unwrap();
            assert_eq!(got.held_bytes().unwrap(), &expect[..], "rank {k}: {name}");
        }
        assert!(rows > 0 && columns > 0 && whole > 0 && experts > 0);
        assert_eq!(
            model.expert_ids(1).unwrap(),
            vec![2 * k as usize, 2 * k as usize + 1]
        );
    }
}

/// transformers' `tp_size=n` alone: the plan cuts the routed experts too (gate and up by
/// rows, `packed_colwise` of the fused gate_up; down by columns): every expert held, each
/// of its tensors numpy's cut of the file's.
#[test]
fn a_plan_cutting_the_experts_holds_each_experts_rows_and_columns() {
    let Some(dir) = fixtures("a_plan_cutting_the_experts_holds_each_experts_rows_and_columns")
    else {
        return;
    };
    let all = NodeSet::parse("all").unwrap();
    let checkpoint = open_fixture(&dir, "st-sharded");
    let want = numpy_tensors(&dir.join("st-sharded"));
    let framework = FrameworkPlan::from_json(
        r#"{"layers.*.mlp.experts.*.gate_proj": "packed_colwise",
            "layers.*.mlp.experts.*.up_proj": "colwise",
            "layers.*.mlp.experts.*.down_proj": "rowwise"}"#,
    )
    .unwrap();
    for k in 0..2u64 {
        let plan = framework.share(&checkpoint, base(all), k, 2).unwrap();
        let model = checkpoint
            .place(&plan, StoreOptions::default().loader_threads(2))
            .unwrap();
        assert!(model.verify(&checkpoint).unwrap().verified());
        let (mut rows, mut columns) = (0, 0);
        for (name, shape, bytes) in &want {
            let expect = if !name.contains(".experts.") {
                bytes.clone()
            } else if name.contains("down_proj") {
                columns += 1;
                cut(bytes, shape, false, k as usize, 2)
            } else {
                rows += 1;
                cut(bytes, shape, true, k as usize, 2)
            };
            let got = model.tensor(name).unwrap();
            assert_eq!(got.held_bytes().unwrap(), &expect[..], "rank {k}: {name}");
        }
        assert!(rows > 0 && columns > 0);
    }
}

fn refused(checkpoint: &Checkpoint, json: &str, ranks: u64) -> String {
    refused_typed(checkpoint, json, ranks).to_string()
}

fn refused_typed(checkpoint: &Checkpoint, json: &str, ranks: u64) -> Error {
    let all = NodeSet::parse("all").unwrap();
    let plan = FrameworkPlan::from_json(json).unwrap();
    plan.share(checkpoint, base(all), 0, ranks)
        .map(|_| ())
        .expect_err(json)
}

/// Each refusal is an `Invalid::BadValue` saying what it refuses: the rank count (an
/// axis it does not divide), a style on a tensor, the plan (an expert left uncut).
#[test]
fn refusals_are_typed_by_what_they_refuse() {
    let Some(dir) = fixtures("refusals_are_typed_by_what_they_refuse") else {
        return;
    };
    let checkpoint = open_fixture(&dir, "st-sharded");
    let what = |json: &str, ranks: u64| match refused_typed(&checkpoint, json, ranks) {
        Error::InvalidArgument {
            op: "FrameworkPlan::share",
            reason: Invalid::BadValue { what, value, .. },
        } => (what, value),
        e => panic!("{json}: {e:?}"),
    };
    // q_proj has 64 rows: 3 ranks do not divide them, 2 do.
    assert_eq!(
        what(r#"{"layers.*.self_attn.q_proj": "colwise"}"#, 3),
        ("rank count", "3".to_owned())
    );
    assert_eq!(
        what(r#"{"layers.*.mlp.gate_proj": "packed_colwise"}"#, 2).0,
        "framework plan style"
    );
    let down_by_rows = r#"{"layers.*.mlp.experts.*.gate_proj": "colwise",
        "layers.*.mlp.experts.*.up_proj": "colwise",
        "layers.*.mlp.experts.*.down_proj": "colwise"}"#;
    assert_eq!(what(down_by_rows, 2).0, "framework plan style");
    let (w, value) = what(r#"{"layers.*.mlp.experts.*.gate_proj": "colwise"}"#, 2);
    assert!(
        w == "framework plan" && value.contains("experts.0."),
        "{w} {value}"
    );
}

#[test]
fn bad_plans_are_refused_by_name() {
    let Some(dir) = fixtures("bad_plans_are_refused_by_name") else {
        return;
    };
    let checkpoint = open_fixture(&dir, "st-sharded");
    let e = refused(
        &checkpoint,
        r#"{"layers.*.self_attn.q_proj": "colwize"}"#,
        2,
    );
    assert!(
        e.contains("model.layers.0.self_attn.q_proj.weight") && e.contains("colwize"),
        "{e}"
    );
    let e = refused(
        &checkpoint,
        r#"{"layers.*.self_attn.q_proj": "colwise"}"#,
        3,
    );
    assert!(
        e.contains("q_proj") && e.contains("64") && e.contains("3 ranks"),
        "{e}"
    );
    let e = refused(
        &checkpoint,
        r#"{"layers.*.mlp.experts.*.gate_proj": "colwise"}"#,
        2,
    );
    // Tensor parallelism of the experts cuts every one of their roles, or none.
    assert!(
        e.contains("experts.0.") && e.contains("routed expert") && e.contains("does not cut"),
        "{e}"
    );
    // ... and each on its role's axis: down by columns, not rows.
    let e = refused(
        &checkpoint,
        r#"{"layers.*.mlp.experts.*.gate_proj": "colwise",
            "layers.*.mlp.experts.*.up_proj": "colwise",
            "layers.*.mlp.experts.*.down_proj": "colwise"}"#,
        2,
    );
    assert!(
        e.contains("experts.0.down_proj") && e.contains("rows"),
        "{e}"
    );
    let e = refused(
        &checkpoint,
        r#"{"layers.*.mlp.gate_proj": "packed_colwise"}"#,
        2,
    );
    assert!(e.contains("gate_proj") && e.contains("packed"), "{e}");
    let e = refused(&checkpoint, r#"{"nothing.here": "sideways"}"#, 2);
    assert!(e.contains("nothing.here") && e.contains("sideways"), "{e}");
    assert!(FrameworkPlan::from_json(r#"["colwise"]"#).is_err());
    assert!(FrameworkPlan::from_json(r#"{"a": 1}"#).is_err());
}

#[test]
fn a_cut_that_splits_a_head_is_refused_naming_the_heads() {
    let Some(dir) = fixtures("a_cut_that_splits_a_head_is_refused_naming_the_heads") else {
        return;
    };
    // The fixture's model directory with a config.json that says 2 attention heads.
    let tmp = std::env::temp_dir().join(format!("numapin-heads-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let src = dir.join("st-sharded/model");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tmp.join(path.file_name().unwrap())).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    config["num_attention_heads"] = 2.into();
    config["num_key_value_heads"] = 1.into();
    std::fs::write(tmp.join("config.json"), config.to_string()).unwrap();
    let checkpoint = Checkpoint::open(&tmp).unwrap();
    assert_eq!(checkpoint.attention_heads(), Some((2, 1)));
    let plan = r#"{"layers.*.self_attn.q_proj": "colwise"}"#;
    let e = refused(&checkpoint, plan, 4);
    assert!(
        e.contains("q_proj") && e.contains("num_attention_heads = 2") && e.contains("4 ranks"),
        "{e}"
    );
    // 2 ranks: one head each, no head split.
    let all = NodeSet::parse("all").unwrap();
    FrameworkPlan::from_json(plan)
        .unwrap()
        .share(&checkpoint, base(all), 1, 2)
        .unwrap();
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// `numapin place --framework-plan FILE --slice tp:k/n`: the share the library builds,
/// and an unknown style refused by name with nothing placed.
#[test]
fn the_cli_takes_a_framework_plan_file() {
    let Some(dir) = fixtures("the_cli_takes_a_framework_plan_file") else {
        return;
    };
    let bin =
        std::env::var_os("NUMAPIN_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_numapin").into());
    let model = dir.join("st-sharded/model");
    let file = std::env::temp_dir().join(format!("numapin-fplan-{}.json", std::process::id()));
    let run = |json: &str| {
        std::fs::write(&file, json).unwrap();
        std::process::Command::new(&bin)
            .args(["place", "--model"])
            .arg(&model)
            .args([
                "--plan",
                "default",
                "--slice",
                "tp:1/2",
                "--experts",
                "1/2",
                "--json",
            ])
            .arg("--framework-plan")
            .arg(&file)
            .output()
            .unwrap()
    };
    let out = run(r#"{"layers.*.self_attn.o_proj": "rowwise"}"#);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let share = json["share"].as_str().unwrap();
    assert!(
        share.contains("model.layers.*.self_attn.o_proj.weight columns:1/2")
            && !share.contains("q_proj")
            && share.starts_with("experts 1/2"),
        "{share}"
    );
    assert_eq!(json["verified"], true, "{json}");
    let out = run(r#"{"layers.*.self_attn.o_proj": "sideways"}"#);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("o_proj.weight") && stderr.contains("sideways"),
        "{stderr}"
    );
    std::fs::remove_file(&file).unwrap();
}
