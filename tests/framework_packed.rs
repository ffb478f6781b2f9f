//! Tensor parallelism of a fused expert tensor the file holds whole (issue 33, Granite's
//! `input_linear [E, 2I, H]`, gate rows then up rows): transformers' `packed_colwise`
//! holds rows `k/n` of each half, back to back, and numapin places exactly that in each
//! expert's slot, the layer's experts one stride apart (one strided view). The expected
//! bytes are cut here from the file's own bytes, its safetensors header parsed by this
//! test (no numapin code in the reference).
#![cfg(feature = "model")]

use std::path::{Path, PathBuf};

use numapin::model::{
    Checkpoint, DenseLayout, FrameworkPlan, PlacementPlan, SliceAxis, TensorSlice,
};
use numapin::store::{Layout, StoreOptions};
use numapin::{Error, Invalid, NodeSet};

const E: u64 = 4;
const H: u64 = 8;
/// bf16: 2 bytes an element.
const B: u64 = 2;

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("framework_packed")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn input(l: u64) -> String {
    format!("model.layers.{l}.block_sparse_moe.input_linear.weight")
}

fn output(l: u64) -> String {
    format!("model.layers.{l}.block_sparse_moe.output_linear.weight")
}

/// A Granite-MoE-shaped safetensors file (two layers: router, `input_linear [E, 2I, H]`,
/// `output_linear [E, H, I]`, BF16, every byte distinct enough to catch a wrong row).
fn granite(dir: &Path, i: u64) -> PathBuf {
    let mut header = Vec::new();
    let mut data = Vec::new();
    let mut add = |name: String, shape: [u64; 3]| {
        let shape: Vec<u64> = shape.into_iter().filter(|&d| d > 0).collect();
        let n = (shape.iter().product::<u64>() * B) as usize;
        let start = data.len();
        data.extend((0..n).map(|x| (x.wrapping_mul(131) ^ (x >> 8) ^ start) as u8));
        header.push(format!(
            r#""{name}":{{"dtype":"BF16","shape":{shape:?},"data_offsets":[{start},{}]}}"#,
            data.len()
        ));
    };
    for l in 0..2 {
        add(
            format!("model.layers.{l}.block_sparse_moe.router.layer.weight"),
            [E, H, 0],
        );
        add(input(l), [E, 2 * i, H]);
        add(output(l), [E, H, i]);
    }
    let header = format!("{{{}}}", header.join(","));
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.extend(data);
    let path = dir.join("model.safetensors");
    std::fs::write(&path, file).unwrap();
    path
}

/// The bytes of tensor `name` in the file at `path`, from its header's `data_offsets`.
fn file_tensor(path: &Path, name: &str) -> Vec<u8> {
    let file = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&file[8..8 + n]).unwrap();
    let offsets = header[name]["data_offsets"].as_array().unwrap();
    let (a, b) = (
        offsets[0].as_u64().unwrap() as usize,
        offsets[1].as_u64().unwrap() as usize,
    );
    file[8 + n + a..8 + n + b].to_vec()
}

/// Rank `k` of `n`'s share of expert `e` of an `input_linear [E, 2I, H]`: gate rows
/// `k·I/n..(k+1)·I/n`, then the same rows of up (rows `I + …`).
fn packed_rows(bytes: &[u8], i: u64, e: u64, k: u64, n: u64) -> Vec<u8> {
    let row = (H * B) as usize;
    let expert = (e * 2 * i) as usize * row;
    let each = (i / n) as usize;
    let mut out = Vec::new();
    for half in [0, i as usize] {
        let first = expert + (half + k as usize * each) * row;
        out.extend_from_slice(&bytes[first..first + each * row]);
    }
    out
}

/// Rank `k` of `n`'s share of expert `e` of an `output_linear [E, H, I]`: columns
/// `k·I/n..(k+1)·I/n` of each of its `H` rows.
fn columns(bytes: &[u8], i: u64, e: u64, k: u64, n: u64) -> Vec<u8> {
    let row = (i * B) as usize;
    let each = row / n as usize;
    let expert = (e * H) as usize * row;
    (0..H as usize)
        .flat_map(|r| {
            let first = expert + r * row + k as usize * each;
            bytes[first..first + each].to_vec()
        })
        .collect()
}

fn base() -> PlacementPlan {
    let all = NodeSet::parse("all").unwrap();
    PlacementPlan::new(Layout::SplitExperts(all), DenseLayout::Replicate(all))
}

const PLAN: &str = r#"{"layers.*.block_sparse_moe.input_linear": "packed_colwise",
                       "layers.*.block_sparse_moe.output_linear": "rowwise"}"#;

/// Every rank `k` of `n` (2 and 4), under transformers' plan and under numapin's own
/// tensor-parallel preset: each expert's gate_up is the file's gate rows `k/n` then up
/// rows `k/n` (`[2I/n, H]`), its down the columns `k/n`; the experts' gate_up views lie
/// one stride apart (the layer's `[E, 2I/n, H]` is one strided view); verify passes.
#[test]
fn each_rank_holds_rows_k_of_n_of_each_half_of_a_file_fused_gate_up() {
    let dir = scratch("each_rank");
    let i = 8;
    let path = granite(&dir, i);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let framework = FrameworkPlan::from_json(PLAN).unwrap();
    let mut checked = 0;
    for n in [2u64, 4] {
        for k in 0..n {
            let plans = [
                framework.share(&checkpoint, base(), k, n).unwrap(),
                base().tensor_parallel(k, n).unwrap(),
            ];
            for plan in plans {
                let model = checkpoint
                    .place(&plan, StoreOptions::default().loader_threads(1))
                    .unwrap();
                assert!(model.verify(&checkpoint).unwrap().verified(), "{k}/{n}");
                for l in 0..2 {
                    let gate_up = file_tensor(&path, &input(l));
                    let down = file_tensor(&path, &output(l));
                    let mut addresses = Vec::new();
                    for e in 0..E {
                        let views = model.expert(l as usize, e as usize).unwrap();
                        let fused = views.iter().find(|v| v.canonical == "gate_up").unwrap();
                        assert_eq!(fused.shape, vec![2 * i / n, H], "{k}/{n} layer {l}");
                        assert_eq!(
                            fused.bytes,
                            &packed_rows(&gate_up, i, e, k, n)[..],
                            "rank {k}/{n} layer {l} expert {e}: gate_up"
                        );
                        addresses.push(fused.bytes.as_ptr() as usize);
                        let d = views.iter().find(|v| v.canonical == "down").unwrap();
                        assert_eq!(d.shape, vec![H, i / n]);
                        assert_eq!(d.bytes, &columns(&down, i, e, k, n)[..], "{k}/{n} {e}");
                        checked += 1;
                    }
                    let stride = addresses[1] - addresses[0];
                    assert!(stride >= (2 * i / n * H * B) as usize);
                    for (e, a) in addresses.iter().enumerate() {
                        assert_eq!(*a, addresses[0] + e * stride, "one stride: {k}/{n}");
                    }
                }
            }
        }
    }
    assert_eq!(checked, 2 * (2 + 4) * 2 * E as usize);
}

/// A packed slice in the slice syntax, and a dense tensor refusing it.
#[test]
fn a_packed_slice_reads_and_resolves_to_one_range_per_part() {
    let s = TensorSlice::parse("rows:1/4:2").unwrap();
    assert_eq!(s, TensorSlice::packed(SliceAxis::Rows, 1, 4, 2).unwrap());
    assert_eq!(s.parts(), 2);
    assert_eq!(s.resolve_parts(16).unwrap(), vec![2..4, 10..12]);
    assert!(s.resolve_parts(12).is_err()); // 2 × 4 does not divide 12
    assert!(s.resolve(16).is_err()); // not one range
    assert!(TensorSlice::parse("rows:0/2:0").is_err());
    assert!(TensorSlice::parse("columns:0/2:2").is_err());
    assert_eq!(
        TensorSlice::parse("rows:0/2:1").unwrap().to_string(),
        "rows:0/2"
    );
}

fn refusal(e: Error) -> (&'static str, String) {
    match e {
        Error::InvalidArgument {
            reason: Invalid::BadValue { what, why, .. },
            ..
        } => (what, why),
        e => panic!("{e:?}"),
    }
}

/// Bad input, before anything is placed: a fused gate_up whose `2I` rows do not divide
/// into 2 halves of `n` ranks (I = 6 at 4 ranks: 12 rows, 8 parts), by the rank count
/// and the tensor; a fused gate_up cut `colwise` (it would mix gate and up rows).
#[test]
fn a_fused_gate_up_the_ranks_do_not_divide_is_refused_by_name() {
    let dir = scratch("refused");
    let path = granite(&dir, 6);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let framework = FrameworkPlan::from_json(PLAN).unwrap();
    let (what, why) = refusal(framework.share(&checkpoint, base(), 0, 4).unwrap_err());
    assert_eq!(what, "rank count");
    assert!(
        why.contains("input_linear") && why.contains("2 packed halves"),
        "{why}"
    );
    // 3 ranks divide 2I = 12 into 2 × 3: placed.
    let plan = framework.share(&checkpoint, base(), 2, 3).unwrap();
    let model = checkpoint
        .place(&plan, StoreOptions::default().loader_threads(1))
        .unwrap();
    assert!(model.verify(&checkpoint).unwrap().verified());
    let got = &model.expert(1, 3).unwrap()[0];
    let want = packed_rows(&file_tensor(&path, &input(1)), 6, 3, 2, 3);
    assert_eq!(got.bytes, &want[..]);
    // The preset refuses the same rank count where the slicer cuts.
    let e = checkpoint
        .place(
            &base().tensor_parallel(0, 4).unwrap(),
            StoreOptions::default(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("2 packed blocks"), "{e}");
    let colwise = PLAN.replace("packed_colwise", "colwise");
    let framework = FrameworkPlan::from_json(&colwise).unwrap();
    let (what, why) = refusal(framework.share(&checkpoint, base(), 0, 2).unwrap_err());
    assert_eq!(what, "framework plan style");
    assert!(why.contains("packed_colwise"), "{why}");
}

/// `numapin place --slice tp:k/2 --json` of the file-fused gate_up: the share's JSON says
/// the role is cut in 2 packed blocks (gate rows, then up rows), where each block's held
/// rows start and how many rows it holds in all; the text form says "of each of 2 blocks".
#[cfg(feature = "cli")]
#[test]
fn the_cli_report_says_a_packed_cut_has_parts() {
    let dir = scratch("cli_parts");
    let i = 8;
    granite(&dir, i);
    let run = |k: u64, json: bool| {
        // `NUMAPIN_BIN` where the test runs away from the build (the VM's initramfs).
        let bin =
            std::env::var_os("NUMAPIN_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_numapin").into());
        let mut cmd = std::process::Command::new(bin);
        cmd.args(["place", "--model"]).arg(&dir);
        cmd.args(["--slice", &format!("tp:{k}/2")]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    for k in 0..2 {
        let json: serde_json::Value = serde_json::from_str(&run(k, true)).unwrap();
        let slices = &json["model"]["share"]["slices"];
        for l in ["0", "1"] {
            let roles = slices[l].as_array().unwrap_or_else(|| panic!("{json}"));
            let fused = roles
                .iter()
                .find(|r| r["role"].as_str().unwrap().contains("gate_up"))
                .unwrap_or_else(|| panic!("no gate_up role: {roles:?}"));
            assert_eq!(fused["axis"], "rows", "{fused}");
            assert_eq!(fused["parts"], 2, "{fused}");
            assert_eq!(fused["start"], k * i / 2, "{fused}");
            assert_eq!(fused["len"], i, "{fused}");
            assert_eq!(fused["extent"], 2 * i, "{fused}");
            let down = roles.iter().find(|r| r["role"] == "down").unwrap();
            assert_eq!(down["parts"], 1, "{down}");
            assert_eq!(down["axis"], "columns", "{down}");
        }
        let text = run(k, false);
        let want = format!(
            "rows {}..{} of each of 2 blocks of {i}",
            k * i / 2,
            (k + 1) * i / 2
        );
        assert!(text.contains(&want), "{want} not in:\n{text}");
    }
}
