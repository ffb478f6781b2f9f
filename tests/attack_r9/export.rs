//! A role-major placement under a share, exported and attached with forged manifests the
//! round's tests do not cover: a run's shape, slice, dtype, file offset or rows changed,
//! a run place put on the router, the norm or a role of the other layer, a run place in
//! a manifest whose store is expert-major. Attach must refuse, or every view it gives
//! must be the file's bytes as the view describes them (its slice's rows, its shape
//! times its element size), cut here from the file.

use super::{ROLES, base, dbrx, dup, file_tensor, options, role, scratch};

use std::path::Path;

use numapin::model::{Checkpoint, ExpertShare, ModelManifest, PlacedModel, Share};
use serde_json::{Value, json};

const E: u64 = 4;
const I: u64 = 256;
const H: u64 = 8;

fn edited(bytes: &[u8], edit: &dyn Fn(&mut Value)) -> Vec<u8> {
    let n = bytes.iter().position(|&b| b == b'\n').unwrap();
    let mut body: Value = serde_json::from_slice(&bytes[n + 1..]).unwrap();
    edit(&mut body);
    let mut out = bytes[..=n].to_vec();
    out.extend(serde_json::to_vec(&body).unwrap());
    out
}

fn body(bytes: &[u8]) -> Value {
    let n = bytes.iter().position(|&b| b == b'\n').unwrap();
    serde_json::from_slice(&bytes[n + 1..]).unwrap()
}

fn index(body: &Value, name: &str) -> usize {
    let tensors = body["tensors"].as_array().unwrap();
    tensors.iter().position(|t| t["name"] == name).unwrap()
}

/// Every role tensor of `m` that gives bytes gives the file's rows its slice names, as
/// many as its shape says (BF16); each held expert's piece its own rows.
fn consistent(m: &PlacedModel, path: &Path, what: &str) {
    // Every view given (dense ones too): as many BF16 elements as its shape says.
    for v in m.tensors().flatten() {
        if let Some(b) = v.bytes() {
            let elems: u64 = v.shape().iter().product();
            assert_eq!(
                (v.dtype().to_string(), elems * 2),
                ("BF16".to_owned(), b.len() as u64),
                "{what} {}: shape {:?} is not the bytes given",
                v.name(),
                v.shape()
            );
        }
    }
    for l in 0..2u64 {
        for r in ROLES {
            let name = role(l, r);
            let (shape, file) = file_tensor(path, &name);
            let row = (file.len() as u64 / shape[0]) as usize;
            let view = match m.tensor(&name) {
                Ok(v) => v,
                Err(e) => {
                    eprintln!("{what}: {name}: {e}");
                    continue;
                }
            };
            if let Some(run) = view.bytes() {
                let elems: u64 = view.shape().iter().product();
                assert_eq!(
                    elems * 2,
                    run.len() as u64,
                    "{what} {name}: shape {:?} is not the bytes given",
                    view.shape()
                );
                assert_eq!(view.dtype().to_string(), "BF16", "{what} {name}");
                let (a, n) = view.slice().map_or((0, shape[0]), |s| (s.start, s.len));
                let (a, n) = (a as usize * row, n as usize * row);
                assert!(a + n <= file.len(), "{what} {name}: slice past the tensor");
                assert!(
                    run == &file[a..a + n],
                    "{what} {name}: the bytes are not the rows the view names"
                );
            }
        }
        let per = (I * H * 2) as usize;
        for e in 0..E as usize {
            let Ok(pieces) = m.expert(l as usize, e) else {
                continue;
            };
            for p in pieces {
                let (_, file) = file_tensor(path, p.tensor);
                if ROLES.iter().any(|r| p.tensor == role(l, r)) {
                    assert!(
                        p.bytes == &file[e * per..(e + 1) * per],
                        "{what} {} E{e}",
                        p.tensor
                    );
                }
            }
        }
    }
}

#[test]
fn forged_run_metadata_is_refused_or_the_views_are_the_files_rows() {
    let dir = scratch("export_forged");
    let r = ("BF16", vec![E * I, H]);
    let path = dbrx(&dir, E, [r.clone(), r.clone(), r]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let shares = [
        ExpertShare::part(0, 2),
        ExpertShare::part(1, 2),
        ExpertShare::list([0, 2]),
        ExpertShare::list([3]),
        ExpertShare::list([0, 1, 2, 3]),
    ];
    for (k, share) in shares.into_iter().enumerate() {
        let plan = base().share(Share::default().experts(share.unwrap()));
        let mut model = checkpoint.place(&plan, options().shared(true)).unwrap();
        consistent(&model, &path, "placed");
        let export = model.export().unwrap();
        let bytes = export.manifest.to_bytes();
        let b = body(&bytes);
        assert_eq!(b["roles"], json!(3), "DBRX shared is role-major");
        let w1 = index(&b, &role(0, "w1"));
        let v1 = index(&b, &role(0, "v1"));
        let router = index(&b, "transformer.blocks.0.ffn.router.layer.weight");
        let norm = index(&b, "transformer.blocks.0.norm_attn_norm.norm_1.weight");
        let w1_l1 = index(&b, &role(1, "w1"));
        let mut run = b["tensors"][w1]["place"].clone();
        if k == 2 {
            // Held ids with a gap: no run; forge one over the layer's slots.
            assert!(run.get("ExpertRun").is_none(), "a gap made a run: {run}");
            run = json!({"ExpertRun": {"layer": 0, "first": 0, "count": 2}});
        }
        assert!(run.get("ExpertRun").is_some(), "{run}");
        let shape = b["tensors"][w1]["shape"].clone();
        let rows = shape[0].as_u64().unwrap();
        let slice = b["tensors"][w1]["slice"].clone();
        eprintln!("w1 entry: {}", b["tensors"][w1]);
        type Edit = Box<dyn Fn(&mut Value)>;
        let t = move |i: usize, f: &'static str, v: Value| -> Edit {
            Box::new(move |b: &mut Value| b["tensors"][i][f] = v.clone())
        };
        let mut forged: Vec<(&str, Edit)> = vec![
            ("shape rows x2", t(w1, "shape", json!([rows * 2, H]))),
            (
                "shape rows x2 cols /2",
                t(w1, "shape", json!([rows * 2, H / 2])),
            ),
            ("shape 1-D", t(w1, "shape", json!([rows * H]))),
            ("shape empty", t(w1, "shape", json!([]))),
            ("dtype F32", t(w1, "dtype", json!("st:F32"))),
            ("dtype U8", t(w1, "dtype", json!("st:U8"))),
            ("offset +2", {
                let o = b["tensors"][w1]["offset"].as_u64().unwrap();
                t(w1, "offset", json!(o + 2))
            }),
            ("rows", t(w1, "rows", json!([2, 1]))),
            ("slice none", t(w1, "slice", Value::Null)),
            ("run on the router", t(router, "place", run.clone())),
            ("run on the norm", t(norm, "place", run.clone())),
            ("run on layer 1's w1", t(w1_l1, "place", run.clone())),
            ("v1 gets w1's run and len", {
                let len = b["tensors"][w1]["len"].clone();
                let run = run.clone();
                Box::new(move |b: &mut Value| {
                    b["tensors"][v1]["place"] = run.clone();
                    b["tensors"][v1]["len"] = len.clone();
                })
            }),
            ("class dense", t(w1, "class", json!("Dense"))),
            ("norm shape x2", t(norm, "shape", json!([2 * H]))),
            ("router shape x2", t(router, "shape", json!([2 * E, H]))),
            ("norm dtype F32", t(norm, "dtype", json!("st:F32"))),
        ];
        if slice.is_array() {
            let s = slice.as_array().unwrap().clone();
            let (start, len, extent) = (
                s[1].as_u64().unwrap(),
                s[2].as_u64().unwrap(),
                s[3].as_u64().unwrap(),
            );
            let other = if start == 0 { len } else { 0 };
            forged.push((
                "slice other rows",
                t(w1, "slice", json!([true, other, len, extent])),
            ));
            forged.push((
                "slice columns",
                t(w1, "slice", json!([false, start, len, extent])),
            ));
            forged.push((
                "slice past the extent",
                t(w1, "slice", json!([true, extent, len, extent])),
            ));
            forged.push((
                "slice huge start",
                t(w1, "slice", json!([true, u64::MAX - 1, len, extent])),
            ));
        }
        for (what, edit) in &forged {
            let what = format!("share #{k}: {what}");
            let text = edited(&bytes, edit.as_ref());
            let manifest = match ModelManifest::parse(&text) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("{what}: refused at parse: {e}");
                    continue;
                }
            };
            match PlacedModel::attach_checked(&manifest, dup(&export.files), &checkpoint) {
                Err(e) => eprintln!("{what}: refused: {e}"),
                Ok(m) => {
                    eprintln!("{what}: attached");
                    consistent(&m, &path, &what);
                }
            }
        }
    }
}

/// Exported under a share that differs per layer (layer 0 holds 1-2, a run; layer 1
/// holds 0 and 3, a gap; then the reverse; then one expert and all): the attached model
/// gives each layer's role tensors as the file's rows of its own held experts (or no
/// run), each held expert's pieces its own rows.
#[test]
fn a_per_layer_share_exports_and_attaches_with_each_layers_rows() {
    let dir = scratch("export_per_layer");
    let r = ("BF16", vec![E * I, H]);
    let path = dbrx(&dir, E, [r.clone(), r.clone(), r]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let cases: [[Vec<usize>; 2]; 3] = [
        [vec![1, 2], vec![0, 3]],
        [vec![0, 3], vec![2, 3]],
        [vec![3], vec![0, 1, 2, 3]],
    ];
    for ids in cases {
        let by_layer = ids.clone();
        let share = ExpertShare::per_layer(move |layer, _| {
            ExpertShare::list(by_layer[layer.min(1)].iter().copied())
        });
        let plan = base().share(Share::default().experts(share));
        let mut model = checkpoint.place(&plan, options().shared(true)).unwrap();
        let export = model.export().unwrap();
        let what = format!("per layer {ids:?}");
        let m = PlacedModel::attach_checked(&export.manifest, dup(&export.files), &checkpoint)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        consistent(&m, &path, &what);
        for (l, held) in ids.iter().enumerate() {
            assert_eq!(&m.expert_ids(l).unwrap(), held, "{what} L{l}");
            let consecutive = held.windows(2).all(|w| w[1] == w[0] + 1);
            for r in ROLES {
                let name = role(l as u64, r);
                let (_, file) = file_tensor(&path, &name);
                let per = file.len() / E as usize;
                let run = m.tensor(&name).unwrap().bytes();
                if consecutive {
                    let (a, b) = (held[0] * per, (held[held.len() - 1] + 1) * per);
                    assert!(run == Some(&file[a..b]), "{what} {name}: the held rows");
                } else {
                    assert!(run.is_none(), "{what} {name}: a run over a gap");
                }
                for &e in held {
                    let pieces = m.expert(l, e).unwrap();
                    let p = pieces.iter().find(|p| p.tensor == name).unwrap();
                    assert!(
                        p.bytes == &file[e * per..(e + 1) * per],
                        "{what} {name} E{e}"
                    );
                }
            }
        }
        assert!(m.verify(&checkpoint).unwrap().verified(), "{what}");
    }
}
