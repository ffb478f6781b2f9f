//! Role-major whole placements: DBRX-like files whose role tensors do not divide by the
//! expert count or differ in size, `role_major(R)` with odd R, export + attach, and a
//! byte changed in the file found at its tensor and byte.

use super::{B, base, dup, file_tensor, flip, options, safetensors, scratch};

use std::path::{Path, PathBuf};

use numapin::model::{Checkpoint, PlacedModel};

const E: u64 = 4;
const H: u64 = 8;
/// A piece of `I × H` BF16 is a page: the slots are back to back, each role one run.
const I: u64 = 256;
const ROLES: [&str; 3] = ["w1", "v1", "w2"];

fn role(l: u64, r: &str) -> String {
    format!("transformer.blocks.{l}.ffn.experts.mlp.{r}")
}

/// A DBRX-like file: per layer a router `[E, H]` and `w1/v1/w2` of `rows[r]` × H.
fn dbrx(dir: &Path, rows: [u64; 3]) -> PathBuf {
    let mut t = Vec::new();
    for l in 0..2 {
        t.push((
            format!("transformer.blocks.{l}.ffn.router.layer.weight"),
            vec![E, H],
        ));
        for (r, rows) in ROLES.iter().zip(rows) {
            t.push((role(l, r), vec![rows, H]));
        }
        t.push((
            format!("transformer.blocks.{l}.norm_attn_norm.norm_1.weight"),
            vec![H],
        ));
    }
    let path = dir.join("model.safetensors");
    safetensors(&path, &t);
    path
}

/// Every role tensor's placed bytes are the file's (`tensor(name)` one run).
fn check_runs(model: &PlacedModel, path: &Path, what: &str) {
    for l in 0..2 {
        for r in ROLES {
            let name = role(l, r);
            let (_, want) = file_tensor(path, &name);
            match model.tensor(&name).and_then(|t| t.held_bytes()) {
                Ok(held) => assert_eq!(held, &want[..], "{what}: {name}"),
                // Not one run (slots per expert): each expert's view is its E-th.
                Err(e) => {
                    assert!(e.to_string().contains("expert(layer, e)"), "{what}: {e}");
                    let mut got: Vec<u8> = Vec::new();
                    for x in 0..E as usize {
                        let views = model.expert(l as usize, x).unwrap();
                        got.extend(views.iter().find(|v| v.tensor == name).unwrap().bytes);
                    }
                    assert_eq!(got, want, "{what}: {name} by expert");
                }
            }
        }
    }
}

#[test]
fn role_major_with_any_r_keeps_the_files_bytes_or_is_refused() {
    let dir = scratch("role_major_r");
    let path = dbrx(&dir, [E * I; 3]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let model = checkpoint.place(&base(), options()).unwrap();
    check_runs(&model, &path, "automatic");
    assert!(model.verify(&checkpoint).unwrap().verified());
    drop(model);
    for r in [0usize, 1, 2, 3, 4, 7, usize::MAX, usize::MAX / 2] {
        match checkpoint.place(&base(), options().role_major(r)) {
            Ok(m) => {
                check_runs(&m, &path, &format!("role_major({r})"));
                assert!(m.verify(&checkpoint).unwrap().verified(), "role_major({r})");
            }
            Err(e) => {
                let e = e.to_string();
                eprintln!("role_major({r}): refused: {e}");
                assert!(e.contains("role_major") || e.contains("role"), "{r}: {e}");
            }
        }
    }
}

#[test]
fn role_tensors_not_dividing_by_the_experts_or_unequal_are_refused_or_exact() {
    for (case, rows) in [
        ("indivisible", [E * I + 1, E * I + 1, E * I + 1]),
        ("one_indivisible", [E * I, E * I + 2, E * I]),
        ("unequal", [E * I, 2 * E * I, E * I]),
        ("zero", [0, 0, 0]),
    ] {
        let dir = scratch(case);
        let path = dbrx(&dir, rows);
        let checkpoint = match Checkpoint::open(&path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{case}: refused at open: {e}");
                continue;
            }
        };
        for opts in [options(), options().role_major(3)] {
            match checkpoint.place(&base(), opts) {
                Ok(m) => {
                    check_runs(&m, &path, case);
                    assert!(m.verify(&checkpoint).unwrap().verified(), "{case}");
                }
                Err(e) => eprintln!("{case}: refused: {e}"),
            }
        }
    }
}

#[test]
fn an_exported_role_major_placement_attaches_with_the_files_bytes_or_is_refused() {
    let dir = scratch("role_major_export");
    let path = dbrx(&dir, [E * I; 3]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let mut model = checkpoint.place(&base(), options().shared(true)).unwrap();
    check_runs(&model, &path, "shared");
    let export = match model.export() {
        Ok(x) => x,
        Err(e) => {
            assert!(e.to_string().contains("role"), "{e}");
            return;
        }
    };
    match PlacedModel::attach_checked(&export.manifest, dup(&export.files), &checkpoint) {
        Ok(m) => {
            check_runs(&m, &path, "attached");
            // Each expert's view of each role is its E-th of the run.
            for l in 0..2u64 {
                for e in 0..E {
                    let views = m.expert(l as usize, e as usize).unwrap();
                    for r in ROLES {
                        let name = role(l, r);
                        let (_, file) = file_tensor(&path, &name);
                        let piece = (I * H * B) as usize;
                        let v = views.iter().find(|v| v.tensor == name).unwrap();
                        let e = e as usize;
                        assert_eq!(v.bytes, &file[e * piece..(e + 1) * piece], "{name} {e}");
                    }
                }
            }
            assert!(m.verify(&checkpoint).unwrap().verified());
        }
        Err(e) => assert!(e.to_string().contains("role"), "{e}"),
    }
}

/// One byte changed in a role tensor after placing: verify reports it at that tensor and
/// byte (or at the expert and the byte in its slot).
#[test]
fn a_byte_changed_in_a_role_run_is_found_at_its_tensor_and_byte() {
    let piece = (I * H * B) as usize;
    for (l, r, at) in [
        (0, "w1", 0usize),
        (1, "v1", 3 * piece - 1),
        (1, "w2", 4 * piece - 1),
        (0, "w2", piece + 5),
    ] {
        let dir = scratch(&format!("role_major_flip_{l}_{r}_{at}"));
        let path = dbrx(&dir, [E * I; 3]);
        let checkpoint = Checkpoint::open(&path).unwrap();
        let model = checkpoint.place(&base(), options()).unwrap();
        let name = role(l, r);
        let (offset, _) = file_tensor(&path, &name);
        flip(&path, offset + at);
        let v = model.verify(&checkpoint).unwrap();
        assert!(!v.verified(), "{name} byte {at}: {v:?}");
        let dense = v
            .mismatches
            .iter()
            .any(|m| m.contains(&name) && m.contains(&format!("at byte {at}")));
        let expert = v.experts.as_ref().is_some_and(|x| {
            x.mismatches.iter().any(|m| {
                m.layer == l as usize && m.expert == at / piece && m.slot_offset == at % piece
            })
        });
        // The run compared as a tensor and as its slots: both name the byte.
        assert!(dense && expert, "{name} byte {at}: {v:?}");
        assert_eq!(v.mismatched, 1, "{v:?}");
        assert_eq!(v.experts.as_ref().unwrap().mismatched_slots, 1, "{v:?}");
    }
}
