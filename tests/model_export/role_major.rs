//! A role-major placement exported and attached (issue 33 item 5): DBRX's `w1`/`v1`/`w2`
//! placed shared are role-major (whole, and under an expert share its held experts'
//! rows), the manifest carries the order (`roles`, the store's `role_major`, each run's
//! place), and the attached model gives each role tensor as one run equal to the file's
//! bytes (read here from the safetensors header, not by numapin), each expert's view
//! inside it. Forged orders are refused by name with nothing mapped; a manifest written
//! before role-major exports (no `roles`, no `role_major`) still attaches.

use std::collections::BTreeMap;
use std::path::Path;

use numapin::model::{ExpertShare, ModelManifest, PlacedModel, Share};
use serde_json::{Value, json};

use super::bad::{dup, edited, memfd_mappings, split_replicated};
use super::common::{fixtures, open_fixture};

const EXPERTS: usize = 4;

/// The DBRX fixture's expert tensors from its file: name → (shape, bytes).
fn file_experts(dir: &Path) -> BTreeMap<String, (Vec<u64>, Vec<u8>)> {
    let data = std::fs::read(dir.join("fam-dbrx").join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
    let body = &data[8 + n..];
    let mut out = BTreeMap::new();
    for (name, t) in header.as_object().unwrap() {
        if !name.contains(".ffn.experts.mlp.") {
            continue;
        }
        let shape = t["shape"].as_array().unwrap();
        let at = t["data_offsets"].as_array().unwrap();
        let (a, b) = (at[0].as_u64().unwrap(), at[1].as_u64().unwrap());
        let shape = shape.iter().map(|d| d.as_u64().unwrap()).collect();
        out.insert(name.clone(), (shape, body[a as usize..b as usize].to_vec()));
    }
    out
}

/// Each role tensor of `model` is one run: the file's rows of experts `ids`
/// (consecutive), every held expert's view inside it at its place.
fn check_attached(
    model: &PlacedModel,
    file: &BTreeMap<String, (Vec<u64>, Vec<u8>)>,
    ids: &[usize],
) {
    assert_eq!(file.len(), 6);
    for (name, (shape, bytes)) in file {
        let view = model.tensor(name).unwrap();
        let run = view
            .bytes()
            .unwrap_or_else(|| panic!("{name}: no one run attached"));
        let per = bytes.len() / EXPERTS;
        let (a, n) = (ids[0], ids.len());
        assert!(
            run == &bytes[a * per..(a + n) * per],
            "{name}: the file's rows"
        );
        let rows = shape[0] / EXPERTS as u64;
        assert_eq!(view.shape(), &[rows * n as u64, shape[1]], "{name}");
        let layer = view.layer().unwrap();
        assert_eq!(model.expert_ids(layer).unwrap(), ids);
        for (i, &e) in ids.iter().enumerate() {
            let pieces = model.expert(layer, e).unwrap();
            let p = pieces.iter().find(|p| p.tensor == name).unwrap();
            assert_eq!(p.bytes.as_ptr() as usize, run.as_ptr() as usize + i * per);
        }
        for (_, copy) in model.tensor_copies(name).unwrap() {
            assert!(copy == run, "{name}: a copy");
        }
    }
}

/// The index of the first tensor placed as a run, and its place.
fn first_run(body: &Value) -> (usize, Value) {
    let tensors = body["tensors"].as_array().unwrap();
    tensors
        .iter()
        .enumerate()
        .find_map(|(i, t)| t["place"].get("ExpertRun").map(|p| (i, p.clone())))
        .expect("a run in the manifest")
}

#[test]
fn an_attached_role_major_placement_gives_each_role_as_one_run_of_the_files_bytes() {
    let test = "an_attached_role_major_placement_gives_each_role_as_one_run_of_the_files_bytes";
    let Some(dir) = fixtures(test) else {
        return;
    };
    let _alone = super::ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let checkpoint = open_fixture(&dir, "fam-dbrx");
    let file = file_experts(&dir);
    let held = |k| Share::default().experts(ExpertShare::part(k, 2).unwrap());
    let cases = [
        (split_replicated(), (0..EXPERTS).collect::<Vec<_>>()),
        (split_replicated().share(held(0)), vec![0, 1]),
        (split_replicated().share(held(1)), vec![2, 3]),
    ];
    for (plan, ids) in cases {
        let mut model = checkpoint.place(&plan, super::options()).unwrap();
        check_attached(&model, &file, &ids);
        let export = model.export().unwrap();
        let bytes = export.manifest.to_bytes();
        let manifest = ModelManifest::parse(&bytes).unwrap();
        let attached = PlacedModel::attach_checked(&manifest, dup(&export.files), &checkpoint);
        let attached = attached.unwrap();
        check_attached(&attached, &file, &ids);
        drop(attached);

        // Forged orders: refused by name, nothing mapped.
        let body: Value =
            serde_json::from_slice(&bytes[bytes.iter().position(|&b| b == b'\n').unwrap() + 1..])
                .unwrap();
        assert_eq!(body["roles"], json!(3));
        assert_eq!(body["experts"]["role_major"], json!(3));
        let (run, place) = first_run(&body);
        let count = place["count"].as_u64().unwrap();
        let before = memfd_mappings();
        let refused = |edit: &dyn Fn(&mut Value), want: &str| {
            let forged = edited(&bytes, edit);
            let e = match ModelManifest::parse(&forged) {
                Err(e) => e.to_string(),
                Ok(m) => PlacedModel::attach(&m, dup(&export.files))
                    .err()
                    .unwrap_or_else(|| panic!("{want}: attached"))
                    .to_string(),
            };
            assert!(e.contains(want), "{want}: {e}");
            assert_eq!(memfd_mappings(), before, "mapped after a refusal: {e}");
        };
        refused(&|b| b["roles"] = json!(0), "roles");
        refused(&|b| b["roles"] = json!(2), "role-major x3");
        refused(&|b| b["roles"] = json!(usize::MAX), "role-major x3");
        refused(&|b| b["roles"] = json!(1), "role-major x3");
        refused(&|b| b["experts"]["role_major"] = json!(0), "role_major");
        refused(
            &|b| {
                b["roles"] = json!(6);
                b["experts"]["role_major"] = json!(6);
            },
            "6 weight pieces",
        );
        let forged_run = |field: &'static str, value: Value| {
            move |b: &mut Value| b["tensors"][run]["place"]["ExpertRun"][field] = value.clone()
        };
        refused(&forged_run("first", json!(1)), "role-major run");
        refused(&forged_run("first", json!(3 * count)), "role-major run");
        refused(&forged_run("count", json!(count + 1)), "role-major run");
        refused(&forged_run("count", json!(0)), "role-major run");
        refused(&forged_run("layer", json!(7)), "role-major run");
        refused(&forged_run("first", json!(usize::MAX)), "role-major run");
        // Another tensor's run named for this one (w1's slots on v1's entry).
        let other = body["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .find_map(|(i, t)| {
                let p = t["place"].get("ExpertRun")?;
                (i != run && p["first"] != place["first"] && p["layer"] == place["layer"])
                    .then(|| p.clone())
            });
        let other = other.unwrap();
        refused(
            &move |b: &mut Value| b["tensors"][run]["place"]["ExpertRun"] = other.clone(),
            "role-major run",
        );
        // A run's length forged: the place still names the role; the tensor's len does
        // not match its pieces.
        refused(
            &|b| {
                let len = b["tensors"][run]["len"].as_u64().unwrap();
                b["tensors"][run]["len"] = json!(len * 2);
            },
            "role-major run",
        );
    }
}

/// A manifest written before role-major exports (no `roles`, no `role_major`) of an
/// expert-major placement (tensor parallel cuts DBRX's roles) attaches as before, each
/// expert's view the file's bytes.
#[test]
fn a_manifest_without_the_order_attaches_expert_major() {
    let Some(dir) = fixtures("a_manifest_without_the_order_attaches_expert_major") else {
        return;
    };
    let _alone = super::ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let checkpoint = open_fixture(&dir, "fam-dbrx");
    let file = file_experts(&dir);
    let plan = split_replicated().tensor_parallel(0, 2).unwrap();
    let mut model = checkpoint.place(&plan, super::options()).unwrap();
    let export = model.export().unwrap();
    let old = edited(&export.manifest.to_bytes(), |b: &mut Value| {
        assert_eq!(b["roles"], json!(1));
        b.as_object_mut().unwrap().remove("roles");
        b["experts"].as_object_mut().unwrap().remove("role_major");
    });
    let manifest = ModelManifest::parse(&old).unwrap();
    let attached = PlacedModel::attach(&manifest, dup(&export.files)).unwrap();
    for name in file.keys() {
        assert!(attached.tensor(name).unwrap().bytes().is_none(), "{name}");
        let layer = attached.tensor(name).unwrap().layer().unwrap();
        let here = model.expert(layer, 1).unwrap();
        let there = attached.expert(layer, 1).unwrap();
        let (a, b) = (
            here.iter().find(|p| p.tensor == name).unwrap(),
            there.iter().find(|p| p.tensor == name).unwrap(),
        );
        assert!(a.bytes == b.bytes && !a.bytes.is_empty(), "{name}");
    }
}
