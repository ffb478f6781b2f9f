//! Bad manifests and files: refused by name, with nothing mapped (this process's memfd
//! mappings counted from `/proc/self/maps` before and after each refusal).

use std::fs::File;

use numapin::model::{MAX_MANIFEST_BYTES, ModelManifest, PlacedModel, PlacementPlan};
use numapin::store::Layout;
use numapin::{Error, Invalid};

use super::common::{fixtures, open_fixture};

/// Mappings of numapin's memfds in this process.
pub(super) fn memfd_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:numapin"))
        .count()
}

pub(super) fn dup(files: &[File]) -> Vec<File> {
    files.iter().map(|f| f.try_clone().unwrap()).collect()
}

/// The manifest's JSON body, edited by `edit`, back to bytes.
pub(super) fn edited(bytes: &[u8], edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let n = bytes.iter().position(|&b| b == b'\n').unwrap();
    let mut body: serde_json::Value = serde_json::from_slice(&bytes[n + 1..]).unwrap();
    edit(&mut body);
    let mut out = bytes[..=n].to_vec();
    out.extend(serde_json::to_vec(&body).unwrap());
    out
}

/// Experts split and dense tensors replicated over the test's nodes.
pub(super) fn split_replicated() -> PlacementPlan {
    let nodes = super::common::nodes();
    PlacementPlan::new(
        Layout::SplitExperts(nodes),
        numapin::model::DenseLayout::Replicate(nodes),
    )
}

fn parse_err(bytes: &[u8]) -> String {
    ModelManifest::parse(bytes).unwrap_err().to_string()
}

#[test]
fn bad_manifests_and_files_are_refused_by_name_with_nothing_mapped() {
    let Some(dir) = fixtures("bad_manifests_and_files_are_refused_by_name_with_nothing_mapped")
    else {
        return;
    };
    let _alone = super::ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let checkpoint = open_fixture(&dir, "st-sharded");
    let plan = split_replicated();
    // Not placed shared: export is a named error.
    let mut private = checkpoint
        .place(&plan, super::options().shared(false))
        .unwrap();
    let e = private.export().unwrap_err().to_string();
    assert!(
        e.contains("not memfd-backed") && e.contains("shared"),
        "{e}"
    );
    drop(private);

    let mut model = checkpoint.place(&plan, super::options()).unwrap();
    let export = model.export().unwrap();
    let bytes = export.manifest.to_bytes();
    assert_eq!(ModelManifest::parse(&bytes).unwrap(), export.manifest);
    let before = memfd_mappings();
    let attach = |m: &ModelManifest, files: Vec<File>| {
        let e = PlacedModel::attach(m, files).unwrap_err().to_string();
        assert_eq!(memfd_mappings(), before, "mapped after a refusal: {e}");
        e
    };

    // Truncated, oversized, another version, not a manifest.
    let e = parse_err(&bytes[..bytes.len() / 2]);
    assert!(e.contains("EOF"), "{e}");
    let e = parse_err(&vec![b' '; MAX_MANIFEST_BYTES + 1]);
    assert!(e.contains("MAX_MANIFEST_BYTES"), "{e}");
    let mut v2 = bytes.clone();
    v2[14] = b'3'; // "numapin-model 2" -> 3
    assert!(
        parse_err(&v2).contains("unsupported version"),
        "{}",
        parse_err(&v2)
    );
    assert!(parse_err(b"numapin-store 2\n").contains("not a numapin model manifest"));
    // Unknown and duplicate keys, by name; a number that does not fit.
    let e = parse_err(&edited(&bytes, |b| {
        b["bogus"] = 1.into();
    }));
    assert!(e.contains("unknown field `bogus`"), "{e}");
    let text = String::from_utf8(bytes.clone()).unwrap();
    let dup_key = text.replacen("{\"identity\"", "{\"files\":0,\"identity\"", 1);
    let e = parse_err(dup_key.as_bytes());
    assert!(e.contains("duplicate field `files`"), "{e}");
    let e = parse_err(&edited(&bytes, |b| {
        b["files"] = serde_json::json!(-1);
    }));
    assert!(e.contains("-1"), "{e}");
    // A tensor named twice.
    let e = parse_err(&edited(&bytes, |b| {
        let t = b["tensors"][0].clone();
        b["tensors"].as_array_mut().unwrap().push(t);
    }));
    assert!(e.contains("appears twice"), "{e}");

    // Another model's manifest: refused against the checkpoint, before any mapping.
    let other = open_fixture(&dir, "gguf-single");
    let e = PlacedModel::attach_checked(&export.manifest, dup(&export.files), &other)
        .unwrap_err()
        .to_string();
    assert!(e.contains("another model"), "{e}");
    assert_eq!(memfd_mappings(), before);
    let ok = PlacedModel::attach_checked(&export.manifest, dup(&export.files), &checkpoint);
    assert!(ok.is_ok(), "{:?}", ok.err());
    drop(ok);

    // A wrong fd count.
    let mut fewer = dup(&export.files);
    fewer.pop();
    let e = attach(&export.manifest, fewer);
    assert!(e.contains("files, one per region"), "{e}");
    // A regular file, an unsealed memfd, in place of the last region's memfd.
    let mut plain = dup(&export.files);
    *plain.last_mut().unwrap() = File::open(std::env::current_exe().unwrap()).unwrap();
    let e = attach(&export.manifest, plain);
    assert!(e.contains("seal") || e.contains("memfd"), "{e}");
    let unsealed = memfd::MemfdOptions::default()
        .allow_sealing(true)
        .create("numapin-test-unsealed")
        .unwrap()
        .into_file();
    unsealed.set_len(64 << 20).unwrap();
    let mut open = dup(&export.files);
    *open.last_mut().unwrap() = unsealed;
    let e = attach(&export.manifest, open);
    assert!(e.contains("WRITE | SHRINK | GROW"), "{e}");
    // More bytes than the memfd holds (the first region's len, and its stride to fit).
    let greedy = ModelManifest::parse(&edited(&bytes, |b| {
        let region = &mut b["dense"][0][1]["layers"][0]["copies"][0]["regions"][0];
        let len = region["len"].as_u64().unwrap();
        region["len"] = (len + (1 << 30)).into();
    }))
    .unwrap();
    let e = attach(&greedy, dup(&export.files));
    assert!(e.contains("short") || e.contains("bytes"), "{e}");
    // A region naming a file out of range, and two regions naming one file.
    let far = ModelManifest::parse(&edited(&bytes, |b| {
        b["dense"][0][1]["layers"][0]["copies"][0]["regions"][0]["file"] = 1_000_000.into();
    }))
    .unwrap();
    let e = attach(&far, dup(&export.files));
    assert!(e.contains("file index"), "{e}");
    // An expert piece naming a tensor past the table.
    if export.manifest.tensor_count() > 0 {
        let bad = edited(&bytes, |b| {
            if let Some(l) = b["expert_plan"]["layers"].get_mut(0) {
                l["experts"][0][0][0][0] = 1_000_000.into();
            }
        });
        if let Ok(m) = ModelManifest::parse(&bad)
            && m != export.manifest
        {
            let e = attach(&m, dup(&export.files));
            assert!(e.contains("tensor of an expert piece"), "{e}");
        }
    }
    // Every refusal closed its files: the good manifest still attaches.
    let again = PlacedModel::attach(&export.manifest, dup(&export.files)).unwrap();
    assert_eq!(again.len(), model.len());
}

/// A manifest's refusals are typed: `Invalid::BadValue` saying what is bad (the header,
/// the body, a manifest for another model, a region), with the figures in its fields.
#[test]
fn manifest_refusals_are_typed() {
    let Some(dir) = fixtures("manifest_refusals_are_typed") else {
        return;
    };
    let _alone = super::ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let checkpoint = open_fixture(&dir, "st-sharded");
    let plan = split_replicated();
    let mut model = checkpoint.place(&plan, super::options()).unwrap();
    let export = model.export().unwrap();
    let bytes = export.manifest.to_bytes();
    let bad_value = |e: Error| match e {
        Error::InvalidArgument {
            op,
            reason: Invalid::BadValue { what, value, why },
        } => (op, what, value, why),
        e => panic!("{e:?}"),
    };
    let (op, what, value, _) = bad_value(ModelManifest::parse(b"numapin-model 9\n{}").unwrap_err());
    assert_eq!((op, what), ("ModelManifest::parse", "manifest header"));
    assert_eq!(value, "\"numapin-model 9\"");
    let cut = &bytes[..bytes.len() - 1];
    let (_, what, value, _) = bad_value(ModelManifest::parse(cut).unwrap_err());
    let body = cut.len() - cut.iter().position(|&b| b == b'\n').unwrap() - 1;
    assert_eq!((what, value), ("manifest body", format!("of {body} bytes")));
    let other = open_fixture(&dir, "gguf-single");
    let (op, what, value, why) = bad_value(export.manifest.check_identity(&other).unwrap_err());
    assert_eq!(
        (op, what, value.as_str()),
        (
            "PlacedModel::attach_checked",
            "manifest",
            "for another model"
        )
    );
    assert!(
        why.contains("tensors in") || why.contains("file 0"),
        "{why}"
    );
    // A region whose slots run past its length.
    let squeezed = ModelManifest::parse(&edited(&bytes, |b| {
        let region = &mut b["dense"][0][1]["layers"][0]["copies"][0]["regions"][0];
        let len = region["len"].as_u64().unwrap();
        region["stride"] = (len + 1).into();
    }))
    .unwrap();
    let (op, what, value, why) =
        bad_value(PlacedModel::attach(&squeezed, dup(&export.files)).unwrap_err());
    assert_eq!((op, what), ("PlacedModel::attach", "region"));
    assert!(
        value.starts_with("layer ") && why.contains("stride"),
        "{value}: {why}"
    );
}
