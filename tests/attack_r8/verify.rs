//! The windowed verify: a byte changed at a 32 MiB window's edges (buffered and direct),
//! a file shrunk after placing, a 0-byte tensor, two tensors sharing bytes, direct reads
//! of a file on tmpfs.

use super::{B, base, file_tensor, options, safetensors, scratch};

use std::os::unix::fs::FileExt;
use std::path::Path;

use numapin::model::Checkpoint;
use numapin::store::ReadMode;

const MIB: usize = 1 << 20;

fn flip_at(path: &Path, at: usize) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at as u64).unwrap();
    b[0] ^= 0xa5;
    f.write_all_at(&b, at as u64).unwrap();
}

#[test]
fn a_byte_changed_at_a_windows_edge_is_found_at_its_byte() {
    let dir = scratch("window_edges");
    let path = dir.join("model.safetensors");
    let big = "model.layers.0.self_attn.q_proj.weight";
    let small = "model.norm.weight";
    // 40 MiB after a small tensor: windows of 32 MiB end inside the big one.
    let elems = (40 * MIB) as u64 / B;
    safetensors(
        &path,
        &[
            (small.to_owned(), vec![1000]),
            (big.to_owned(), vec![elems / 1024, 1024]),
        ],
    );
    let checkpoint = Checkpoint::open(&path).unwrap();
    let (offset, bytes) = file_tensor(&path, big);
    let (s_offset, s_bytes) = file_tensor(&path, small);
    for mode in [ReadMode::Buffered, ReadMode::Direct] {
        let model = checkpoint
            .place(&base(), options().read_mode(mode))
            .unwrap();
        assert!(model.verify_in_mode(&checkpoint, mode).unwrap().verified());
        let mut cases: Vec<(&str, usize)> = vec![
            (big, 0),
            (big, 32 * MIB - 1),
            (big, 32 * MIB),
            (big, 32 * MIB + 1),
            (big, bytes.len() - 1),
            (small, 0),
            (small, s_bytes.len() - 1),
        ];
        // File offsets at 32 MiB and 32 MiB - 1 (aligned windows of the file).
        for file_at in [32 * MIB - 1, 32 * MIB, 4096 - 1, 4096] {
            if file_at >= offset {
                cases.push((big, file_at - offset));
            } else if file_at >= s_offset && file_at < s_offset + s_bytes.len() {
                cases.push((small, file_at - s_offset));
            }
        }
        for (name, at) in cases {
            let base_at = if name == big { offset } else { s_offset };
            flip_at(&path, base_at + at);
            let v = model.verify_in_mode(&checkpoint, mode);
            flip_at(&path, base_at + at);
            let v = v.unwrap();
            let what = format!("{mode:?} {name} byte {at}");
            assert!(!v.verified(), "{what}");
            // One mismatch per copy of the tensor (a replicated class on several nodes).
            let copies = model.tensor_copies(name).unwrap().len();
            assert_eq!(v.mismatched, copies, "{what}: {:?}", v.mismatches);
            assert!(
                v.mismatches
                    .iter()
                    .all(|m| m.contains(name)
                        && m.contains(&format!("first difference at byte {at}"))),
                "{what}: {:?}",
                v.mismatches
            );
        }
        assert!(model.verify_in_mode(&checkpoint, mode).unwrap().verified());
    }
}

#[test]
fn a_file_shrunk_after_placing_fails_verify_by_name_without_a_panic() {
    let dir = scratch("shrunk");
    let path = dir.join("model.safetensors");
    let name = "model.layers.0.self_attn.q_proj.weight";
    safetensors(&path, &[(name.to_owned(), vec![3 * 1024, 1024])]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let (offset, bytes) = file_tensor(&path, name);
    for mode in [ReadMode::Buffered, ReadMode::Direct] {
        let model = checkpoint
            .place(&base(), options().read_mode(mode))
            .unwrap();
        for keep in [
            offset + bytes.len() - 1,
            offset + bytes.len() / 2,
            offset,
            0,
        ] {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.set_len(keep as u64).unwrap();
            match model.verify_in_mode(&checkpoint, mode) {
                Ok(v) => assert!(!v.verified(), "{mode:?} shrunk to {keep}: verified"),
                Err(e) => {
                    let e = e.to_string();
                    assert!(e.contains("verify") || e.contains("read"), "{e}");
                }
            }
        }
        // Restore for the next mode.
        safetensors(&path, &[(name.to_owned(), vec![3 * 1024, 1024])]);
    }
}

#[test]
fn a_zero_byte_tensor_and_tensors_sharing_bytes_verify_as_the_file_is() {
    let dir = scratch("zero_and_shared");
    let path = dir.join("model.safetensors");
    let zero = "model.layers.0.input_layernorm.weight";
    let q = "model.layers.0.self_attn.q_proj.weight";
    safetensors(
        &path,
        &[(zero.to_owned(), vec![0]), (q.to_owned(), vec![64, 64])],
    );
    let checkpoint = Checkpoint::open(&path).unwrap();
    let model = checkpoint.place(&base(), options()).unwrap();
    let v = model.verify(&checkpoint).unwrap();
    assert!(v.verified(), "{v:?}");
    assert_eq!(model.tensor(zero).unwrap().held_bytes().unwrap().len(), 0);
    let (_, want) = file_tensor(&path, q);
    assert_eq!(model.tensor(q).unwrap().held_bytes().unwrap(), &want[..]);

    // Two names over the same bytes: refused at open, or both hold them and a byte
    // changed there is found in both.
    let shared = dir.join("shared.safetensors");
    let data: Vec<u8> = (0..8192u32).map(|x| (x * 31 % 251) as u8).collect();
    let header = format!(
        r#"{{"{q}":{{"dtype":"BF16","shape":[64,64],"data_offsets":[0,8192]}},"model.layers.0.self_attn.k_proj.weight":{{"dtype":"BF16","shape":[64,64],"data_offsets":[0,8192]}}}}"#
    );
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    let at = file.len();
    file.extend(&data);
    std::fs::write(&shared, &file).unwrap();
    let checkpoint = match Checkpoint::open(&shared) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tensors sharing bytes: refused at open: {e}");
            return;
        }
    };
    let model = checkpoint.place(&base(), options()).unwrap();
    assert!(model.verify(&checkpoint).unwrap().verified());
    for name in [q, "model.layers.0.self_attn.k_proj.weight"] {
        assert_eq!(model.tensor(name).unwrap().held_bytes().unwrap(), &data[..]);
    }
    flip_at(&shared, at + 100);
    let v = model.verify(&checkpoint).unwrap();
    assert_eq!(v.mismatched, 2, "{:?}", v.mismatches);
    assert!(
        v.mismatches
            .iter()
            .all(|m| m.contains("first difference at byte 100"))
    );
}

#[test]
fn direct_reads_of_a_file_on_tmpfs_fall_back_and_verify() {
    let dir = Path::new("/dev/shm").join(format!("numapin-attack-r8-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let path = dir.join("model.safetensors");
    let name = "model.layers.0.self_attn.q_proj.weight";
    safetensors(&path, &[(name.to_owned(), vec![1024, 1024])]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let model = checkpoint.place(&base(), options().read_mode(ReadMode::Direct));
    let result = model.map(|m| {
        let v = m.verify_in_mode(&checkpoint, ReadMode::Direct).unwrap();
        let (offset, bytes) = file_tensor(&path, name);
        assert_eq!(m.tensor(name).unwrap().held_bytes().unwrap(), &bytes[..]);
        flip_at(&path, offset + 12345);
        let bad = m.verify_in_mode(&checkpoint, ReadMode::Direct).unwrap();
        (v, bad)
    });
    let _ = std::fs::remove_dir_all(&dir);
    let (v, bad) = result.unwrap();
    assert!(v.verified(), "{v:?}");
    assert!(
        !bad.verified() && bad.mismatches[0].contains("at byte 12345"),
        "{bad:?}"
    );
}
