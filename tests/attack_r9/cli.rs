//! `numapin place --slice tp:k/n --json`: each role slice's `parts`, and hostile `k/n`
//! (0/0, k >= n, huge n) refused by the CLI with a message and a failing status, never a
//! panic (exit 101) or a signal.

#![cfg(feature = "cli")]

use super::{Spec, file_tensor, safetensors, scratch};

const E: u64 = 4;
const H: u64 = 8;
const I: u64 = 8;

fn granite(dir: &std::path::Path) {
    let mut t: Vec<Spec> = Vec::new();
    for l in 0..2 {
        let p = format!("model.layers.{l}.block_sparse_moe");
        t.push((format!("{p}.router.layer.weight"), "BF16", vec![E, H]));
        t.push((
            format!("{p}.input_linear.weight"),
            "BF16",
            vec![E, 2 * I, H],
        ));
        t.push((format!("{p}.output_linear.weight"), "BF16", vec![E, H, I]));
    }
    safetensors(&dir.join("model.safetensors"), &t);
}

fn run(dir: &std::path::Path, slice: &str) -> std::process::Output {
    // `NUMAPIN_BIN` where the test runs away from the build (the VM's initramfs).
    let bin =
        std::env::var_os("NUMAPIN_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_numapin").into());
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["place", "--model"]).arg(dir);
    cmd.args(["--slice", slice, "--json"]);
    cmd.output().unwrap()
}

#[test]
fn cli_share_slices_say_their_parts_or_bad_k_n_are_refused() {
    let dir = scratch("cli");
    granite(&dir);
    let (shape, _) = file_tensor(
        &dir.join("model.safetensors"),
        "model.layers.0.block_sparse_moe.input_linear.weight",
    );
    let rows = shape[1];
    for (k, n) in [(0u64, 1u64), (0, 2), (1, 2), (3, 4), (0, 8), (7, 8)] {
        let out = run(&dir, &format!("tp:{k}/{n}"));
        let err = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            assert_eq!(out.status.code(), Some(1).or(out.status.code()), "{err}");
            assert_ne!(out.status.code(), Some(101), "tp:{k}/{n} panicked: {err}");
            // Refused only where the packed halves do not divide by n.
            assert!(!I.is_multiple_of(n), "tp:{k}/{n} refused: {err}");
            continue;
        }
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let slices = &json["model"]["share"]["slices"];
        for l in ["0", "1"] {
            let Some(roles) = slices[l].as_array() else {
                assert_eq!(n, 1, "tp:{k}/{n}: no slices: {json}");
                continue;
            };
            let fused = roles
                .iter()
                .find(|r| r["role"].as_str().unwrap().contains("gate_up"))
                .unwrap();
            // Independent arithmetic: rows k/n of each of the 2 halves of 2I rows.
            assert_eq!(fused["parts"], 2, "tp:{k}/{n}: {fused}");
            assert_eq!(fused["start"], k * (rows / 2) / n, "{fused}");
            assert_eq!(fused["len"], rows / n, "tp:{k}/{n}: {fused}");
            assert_eq!(fused["extent"], rows, "{fused}");
            for r in roles {
                let p = r["parts"].as_u64().unwrap();
                assert!(p >= 1, "{r}");
                assert_eq!(r["len"].as_u64().unwrap() % p, 0, "{r}");
            }
        }
    }
    for bad in [
        "tp:0/0",
        "tp:1/1",
        "tp:2/2",
        "tp:5/2",
        "tp:0/18446744073709551615",
        "tp:18446744073709551614/18446744073709551615",
        "tp:0/18446744073709551616",
        "tp:-1/2",
        "tp:1/",
        "tp:/2",
        "tp:0/2/2",
        "tp:0/3",
        "tp:1/16",
        "tp:0/9223372036854775808",
    ] {
        let out = run(&dir, bad);
        let err = String::from_utf8_lossy(&out.stderr);
        eprintln!("{bad}: {:?}: {}", out.status.code(), err.trim());
        assert!(
            !out.status.success(),
            "{bad} accepted: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(out.status.code().is_some(), "{bad}: killed by a signal");
        assert_ne!(out.status.code(), Some(101), "{bad}: panicked: {err}");
        assert!(!err.trim().is_empty(), "{bad}: no message");
        assert!(!err.contains("panicked"), "{bad}: {err}");
    }
}

/// `tp:k/n` of a DBRX-like file (roles flattened `[E·I, H]`): each role slice is one
/// part, `k/n` of its axis by integer arithmetic; refused where it does not divide.
#[test]
fn cli_tp_slices_of_dbrx_roles_are_k_of_n() {
    let dir = scratch("cli_dbrx");
    let r = ("BF16", vec![4 * 8, 8]);
    super::dbrx(&dir, 4, [r.clone(), r.clone(), r]);
    for (k, n) in [(0u64, 2u64), (1, 2), (3, 4), (0, 8), (2, 3)] {
        let out = run(&dir, &format!("tp:{k}/{n}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(101), "tp:{k}/{n} panicked: {err}");
        if !out.status.success() {
            eprintln!("tp:{k}/{n}: refused: {err}");
            assert!(!8u64.is_multiple_of(n), "tp:{k}/{n} refused: {err}");
            continue;
        }
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let slices = &json["model"]["share"]["slices"];
        let mut seen = 0;
        for l in ["0", "1"] {
            let Some(roles) = slices[l].as_array() else {
                continue;
            };
            for r in roles {
                seen += 1;
                let (start, len, extent) = (
                    r["start"].as_u64().unwrap(),
                    r["len"].as_u64().unwrap(),
                    r["extent"].as_u64().unwrap(),
                );
                assert_eq!(r["parts"], 1, "tp:{k}/{n}: {r}");
                assert_eq!(len * n, extent, "tp:{k}/{n}: {r}");
                assert_eq!(start, k * len, "tp:{k}/{n}: {r}");
            }
        }
        eprintln!("tp:{k}/{n}: {seen} role slices: {slices}");
    }
}
