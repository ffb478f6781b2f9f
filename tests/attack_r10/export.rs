//! An export manifest's expert plan forged by a hostile process: a piece's tensor or file
//! index at or past 2^32 (where a `u32` cast would wrap onto a real tensor or file), past
//! the checkpoint's file table, or a range past its file's end. Attach must refuse each by
//! name before anything is mapped; the unforged manifest attaches and gives the file's
//! rows (cut here from the file's own header).

use super::{ROLES, base, dbrx, dup, file_tensor, options, role, scratch};

use numapin::model::{Checkpoint, ModelManifest, PlacedModel};
use serde_json::{Value, json};

const E: u64 = 4;
const I: u64 = 64;
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

/// Every held expert's role pieces of `m` are the file's rows of that expert.
fn experts_are_the_files(m: &PlacedModel, path: &std::path::Path) -> usize {
    let per = (I * H * 2) as usize;
    let mut compared = 0;
    for l in 0..2u64 {
        for e in 0..E as usize {
            for p in m.expert(l as usize, e).unwrap() {
                if ROLES.iter().any(|r| p.tensor == role(l, r)) {
                    let (_, file) = file_tensor(path, p.tensor);
                    assert!(
                        p.bytes == &file[e * per..(e + 1) * per],
                        "layer {l} expert {e} {} is not the file's rows",
                        p.tensor
                    );
                    compared += 1;
                }
            }
        }
    }
    compared
}

#[test]
fn forged_piece_indices_past_u32_or_the_file_table_are_refused_by_name() {
    let dir = scratch("export_indices");
    let r = ("BF16", vec![E * I, H]);
    let path = dbrx(&dir, E, [r.clone(), r.clone(), r]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let file_len = std::fs::metadata(&path).unwrap().len();
    let mut model = checkpoint.place(&base(), options().shared(true)).unwrap();
    let export = model.export().unwrap();
    let bytes = export.manifest.to_bytes();
    // The unforged manifest: attaches, every role piece is the file's rows.
    let manifest = ModelManifest::parse(&bytes).unwrap();
    let m = PlacedModel::attach_checked(&manifest, dup(&export.files), &checkpoint).unwrap();
    assert_eq!(
        experts_are_the_files(&m, &path),
        2 * E as usize * ROLES.len()
    );
    drop(m);

    let b = body(&bytes);
    let piece = b["expert_plan"]["layers"][0]["experts"][1][0][0].clone();
    let p: Vec<u64> = piece
        .as_array()
        .unwrap_or_else(|| panic!("no piece in the plan: {}", b["expert_plan"]))
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let (t, f, o, n) = (p[0], p[1], p[2], p[3]);
    assert_eq!(f, 0, "one file");
    assert!(o + n <= file_len);
    let files = 1u64;
    let big = 1u64 << 32;
    let forged: Vec<(&str, [u64; 4])> = vec![
        ("tensor + 2^32 (wraps to its own)", [t + big, f, o, n]),
        ("tensor 2^32", [big, f, o, n]),
        ("tensor u32::MAX", [u64::from(u32::MAX), f, o, n]),
        ("tensor usize::MAX", [u64::MAX, f, o, n]),
        ("file + 2^32 (wraps to its own)", [t, f + big, o, n]),
        ("file u32::MAX", [t, u64::from(u32::MAX), o, n]),
        ("file usize::MAX", [t, u64::MAX, o, n]),
        ("file past the table", [t, files, o, n]),
        ("file far past the table", [t, files + 7, o, n]),
        ("range past the file's end", [t, f, file_len - n + 1, n]),
        ("offset + len overflows", [t, f, u64::MAX - 1, n]),
        ("len past the file", [t, f, o, file_len]),
    ];
    for (what, forged) in forged {
        let text = edited(&bytes, &|b: &mut Value| {
            b["expert_plan"]["layers"][0]["experts"][1][0][0] = json!(forged);
        });
        let manifest = match ModelManifest::parse(&text) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("{what}: refused at parse: {e}");
                continue;
            }
        };
        for checked in [false, true] {
            let got = if checked {
                PlacedModel::attach_checked(&manifest, dup(&export.files), &checkpoint)
            } else {
                PlacedModel::attach(&manifest, dup(&export.files))
            };
            match got {
                Err(e) => {
                    let e = e.to_string();
                    eprintln!("{what}: refused: {e}");
                    assert!(e.contains("PlacedModel::attach"), "{what}: {e}");
                }
                Ok(m) => {
                    let v = m.verify(&checkpoint).map(|v| format!("{v:?}"));
                    panic!("{what} (checked {checked}): attached; verify: {v:?}");
                }
            }
        }
    }
}
