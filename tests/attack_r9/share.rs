//! Role-major slots under an expert share, attacked: held ids with gaps, one expert,
//! all, the last, ids past the layer, more ranks than experts, `role_major(R)` with every
//! R, DBRX-like files whose roles differ in shape or dtype, do not divide by the experts,
//! or hold 0 bytes, and pieces that are not a page (the slots then have padding between
//! them). Every role tensor's bytes are compared with the rows cut here from the file.

use super::{ROLES, base, dbrx, file_tensor, options, role, scratch};

use std::path::Path;

use numapin::model::{Checkpoint, ExpertShare, Share};
use numapin::store::{ReadMode, StoreOptions};

const E: usize = 4;

/// The held ids a share should give of `count` experts, by integer arithmetic; `None` where
/// a rank holds none (the place must then fail).
fn reference_ids(share: &Held, count: usize) -> Option<Vec<usize>> {
    let ids: Vec<usize> = match share {
        Held::List(ids) => {
            let mut v: Vec<usize> = ids.iter().copied().filter(|&i| i < count).collect();
            v.sort_unstable();
            v.dedup();
            v
        }
        Held::Part(k, n) => ((k * count).div_ceil(*n)..((k + 1) * count).div_ceil(*n)).collect(),
    };
    (!ids.is_empty()).then_some(ids)
}

#[derive(Debug, Clone)]
enum Held {
    List(Vec<usize>),
    Part(usize, usize),
}

fn shares(count: usize) -> Vec<Held> {
    let mut v = vec![
        Held::List(vec![0]),
        Held::List(vec![3]),
        Held::List(vec![0, 1, 2, 3]),
        Held::List(vec![1, 3]),
        Held::List(vec![0, 3]),
        Held::List(vec![2, 1]),
        Held::List(vec![1, 1, 2]),
        Held::List(vec![2, 2]),
        Held::List(vec![3, count + 1]),
        Held::List(vec![count]),
        Held::List(vec![count - 1]),
        Held::List((0..count).collect()),
        Held::List((1..count).collect()),
    ];
    for n in [3, 4, 5, 7] {
        for k in 0..n {
            v.push(Held::Part(k, n));
        }
    }
    v
}

/// Places every share of `path` with role_major unasked, `R` = the roles and others,
/// comparing each role tensor with the file's rows of the held experts (one run where
/// the ids are consecutive and the rows divide) and each held expert's piece with its
/// own rows.
fn attack(path: &Path, what: &str) {
    attack_with(path, what, options(), E);
}

fn attack_with(path: &Path, what: &str, options: StoreOptions, count: usize) {
    let checkpoint = match Checkpoint::open(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{what}: refused at open: {e}");
            return;
        }
    };
    for held in shares(count) {
        let share = match &held {
            Held::List(ids) => ExpertShare::list(ids.iter().copied()),
            Held::Part(k, n) => ExpertShare::part(*k, *n),
        };
        let Ok(share) = share else {
            continue;
        };
        let plan = base().share(Share::default().experts(share));
        for roles in [None, Some(1), Some(2), Some(3), Some(4), Some(usize::MAX)] {
            let opts = roles.map_or(options.clone(), |r| options.clone().role_major(r));
            let case = format!("{what} {held:?} role_major {roles:?}");
            let want_ids = reference_ids(&held, count);
            let cost = checkpoint.placement_cost(&plan, &opts);
            let model = match checkpoint.place(&plan, opts) {
                Ok(m) => m,
                Err(e) => {
                    let text = e.to_string();
                    eprintln!("{case}: refused: {text}");
                    assert!(
                        text.contains("role_major") || text.contains("expert"),
                        "{case}: {text}"
                    );
                    continue;
                }
            };
            assert!(cost.is_ok(), "{case}: placed but the dry run refuses");
            let want_ids = want_ids.unwrap_or_else(|| panic!("{case}: a rank of none placed"));
            assert!(
                roles.is_none_or(|r| r == 1 || r == 3),
                "{case}: R other than the roles taken"
            );
            for l in 0..2u64 {
                if let Ok(ids) = model.expert_ids(l as usize) {
                    assert_eq!(ids, want_ids, "{case} L{l}");
                }
                for r in ROLES {
                    check_role(&model, path, l, r, &want_ids, count, &case);
                }
            }
            let v = model.verify(&checkpoint).unwrap();
            assert!(v.verified(), "{case}: {v:?}");
        }
    }
}

fn check_role(
    model: &numapin::model::PlacedModel,
    path: &Path,
    l: u64,
    r: &str,
    ids: &[usize],
    count: usize,
    case: &str,
) {
    let name = role(l, r);
    let (shape, bytes) = file_tensor(path, &name);
    let divides = shape[0] > 0 && shape[0] % count as u64 == 0;
    let rows = shape[0] / count as u64;
    let per = bytes.len() / count;
    let consecutive = ids.windows(2).all(|w| w[1] == w[0] + 1);
    let view = match model.tensor(&name) {
        Ok(v) => v,
        Err(e) => panic!("{case} {name}: {e}"),
    };
    if let Some(run) = view.bytes() {
        let (a, n) = (ids[0], ids.len());
        let want: &[u8] = if n == count || !divides {
            &bytes
        } else {
            assert!(consecutive, "{case} {name}: a run of ids with a gap");
            &bytes[a * per..(a + n) * per]
        };
        assert!(run == want, "{case} {name}: run is not the file's rows");
        let got_rows = view.shape()[0];
        assert_eq!(&view.shape()[1..], &shape[1..], "{case} {name}: shape");
        if let Some(s) = view.slice() {
            assert!(divides, "{case} {name}: a slice of indivisible rows");
            assert_eq!(
                (s.start, s.len, s.extent),
                (a as u64 * rows, n as u64 * rows, shape[0]),
                "{case} {name}: slice"
            );
            assert_eq!(got_rows, n as u64 * rows, "{case} {name}: rows");
        } else {
            assert_eq!(got_rows, shape[0], "{case} {name}: whole shape");
            assert_eq!(run.len(), bytes.len(), "{case} {name}: whole, no slice");
        }
    }
    for e in 0..count {
        let Ok(pieces) = model.expert(l as usize, e) else {
            assert!(
                !ids.contains(&e) || !divides,
                "{case} {name}: E{e} held, no view"
            );
            continue;
        };
        assert!(ids.contains(&e), "{case}: E{e} not held, a view given");
        if let Some(p) = pieces.iter().find(|p| p.tensor == name) {
            assert!(
                divides,
                "{case} {name}: an expert piece of indivisible rows"
            );
            assert!(
                p.bytes == &bytes[e * per..(e + 1) * per],
                "{case} {name} E{e}: not the expert's rows"
            );
        }
    }
}

#[test]
fn held_experts_of_a_page_sized_piece_are_the_files_rows_or_refused() {
    let dir = scratch("share_page");
    let role = ("BF16", vec![E as u64 * 256, 8]);
    let path = dbrx(&dir, E as u64, [role.clone(), role.clone(), role]);
    attack(&path, "page pieces");
    // Direct reads by the read threads (no io_uring), 2 loaders: the same bytes.
    let direct = options()
        .read_mode(ReadMode::Direct)
        .io_uring(false)
        .loader_threads(2);
    attack_with(&path, "page pieces, direct", direct, E);
}

#[test]
fn held_experts_of_odd_sized_pieces_are_the_files_rows_or_refused() {
    let dir = scratch("share_odd");
    let role = ("BF16", vec![E as u64 * 5, 3]);
    let path = dbrx(&dir, E as u64, [role.clone(), role.clone(), role]);
    attack(&path, "30-byte pieces");
    let direct = options()
        .read_mode(ReadMode::Direct)
        .io_uring(false)
        .loader_threads(2);
    attack_with(&path, "30-byte pieces, direct", direct, E);
}

#[test]
fn roles_differing_in_shape_dtype_divisibility_or_empty_are_refused_or_exact() {
    let e = E as u64;
    for (case, roles) in [
        (
            "w2_wider",
            [
                ("BF16", vec![e * 256, 8]),
                ("BF16", vec![e * 256, 8]),
                ("BF16", vec![e * 256, 16]),
            ],
        ),
        (
            "w2_f32",
            [
                ("BF16", vec![e * 256, 8]),
                ("BF16", vec![e * 256, 8]),
                ("F32", vec![e * 256, 8]),
            ],
        ),
        (
            "v1_more_rows",
            [
                ("BF16", vec![e * 256, 8]),
                ("BF16", vec![e * 512, 8]),
                ("BF16", vec![e * 256, 8]),
            ],
        ),
        (
            "indivisible",
            [
                ("BF16", vec![e * 256 + 1, 8]),
                ("BF16", vec![e * 256 + 1, 8]),
                ("BF16", vec![e * 256 + 1, 8]),
            ],
        ),
        (
            "one_indivisible",
            [
                ("BF16", vec![e * 256, 8]),
                ("BF16", vec![e * 256 + 2, 8]),
                ("BF16", vec![e * 256, 8]),
            ],
        ),
        (
            "zero_rows",
            [
                ("BF16", vec![0, 8]),
                ("BF16", vec![0, 8]),
                ("BF16", vec![0, 8]),
            ],
        ),
        (
            "zero_cols",
            [
                ("BF16", vec![e * 256, 0]),
                ("BF16", vec![e * 256, 0]),
                ("BF16", vec![e * 256, 0]),
            ],
        ),
        (
            "one_empty",
            [
                ("BF16", vec![e * 256, 8]),
                ("BF16", vec![e * 256, 8]),
                ("BF16", vec![0, 8]),
            ],
        ),
        (
            "three_d",
            [
                ("BF16", vec![e * 2, 128, 8]),
                ("BF16", vec![e * 2, 128, 8]),
                ("BF16", vec![e * 2, 128, 8]),
            ],
        ),
        (
            "outer_one",
            [
                ("BF16", vec![1, e * 256, 8]),
                ("BF16", vec![1, e * 256, 8]),
                ("BF16", vec![1, e * 256, 8]),
            ],
        ),
        (
            "flat_1d",
            [
                ("BF16", vec![e * 2048]),
                ("BF16", vec![e * 2048]),
                ("BF16", vec![e * 2048]),
            ],
        ),
        (
            "u8_1d",
            [
                ("U8", vec![e * 3]),
                ("U8", vec![e * 3]),
                ("U8", vec![e * 3]),
            ],
        ),
    ] {
        let dir = scratch(case);
        let path = dbrx(&dir, e, roles);
        attack(&path, case);
    }
}

/// A tensor-parallel share cuts DBRX's roles: `role_major(3)` refused by name, and the
/// default gives each expert's piece as rows of that expert's own rows (compared here
/// with the file), never a run of the tensor that is not its rows.
#[test]
fn a_tp_share_of_dbrx_is_refused_role_major_and_no_run_lies() {
    let dir = scratch("share_tp");
    let r = ("BF16", vec![E as u64 * 256, 8]);
    let path = dbrx(&dir, E as u64, [r.clone(), r.clone(), r]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    for (k, n) in [(0, 2), (1, 2), (3, 4), (0, 1)] {
        let plan = base().tensor_parallel(k, n).unwrap();
        let e = checkpoint.place(&plan, options().role_major(3));
        if n > 1 {
            match e {
                Err(e) => assert!(e.to_string().contains("role_major"), "{e}"),
                Ok(_) => panic!("tp {k}/{n}: role_major(3) placed"),
            }
        }
        let model = checkpoint.place(&plan, options()).unwrap();
        for l in 0..2 {
            for x in ROLES {
                let name = role(l, x);
                let (_, bytes) = file_tensor(&path, &name);
                if let Some(run) = model.tensor(&name).unwrap().bytes() {
                    assert!(run == &bytes[..], "tp {k}/{n} {name}: a run not the file's");
                }
            }
        }
        assert!(model.verify(&checkpoint).unwrap().verified(), "tp {k}/{n}");
    }
}

/// A share that differs per layer (an EPLB placement): layer 0 one run of its held
/// experts, layer 1 a gap, one expert, or every expert. Each layer's role tensors are
/// its own held rows (or no run), never another layer's order.
#[test]
fn a_per_layer_share_gives_each_layer_its_own_rows() {
    let dir = scratch("share_per_layer");
    let r = ("BF16", vec![E as u64 * 256, 8]);
    let path = dbrx(&dir, E as u64, [r.clone(), r.clone(), r]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let cases: [[Vec<usize>; 2]; 5] = [
        [vec![0, 1], vec![1, 3]],
        [vec![1, 3], vec![2, 3]],
        [vec![3], vec![0, 1, 2, 3]],
        [vec![0, 1, 2, 3], vec![0]],
        [vec![1, 2], vec![2, 3]],
    ];
    for ids in cases {
        let by_layer = ids.clone();
        let share = ExpertShare::per_layer(move |layer, _| {
            ExpertShare::list(by_layer[layer.min(1)].iter().copied())
        });
        let plan = base().share(Share::default().experts(share));
        for opts in [options(), options().role_major(3)] {
            let case = format!("per layer {ids:?}");
            let model = match checkpoint.place(&plan, opts) {
                Ok(m) => m,
                Err(e) => panic!("{case}: {e}"),
            };
            for l in 0..2u64 {
                let want = &ids[l as usize];
                assert_eq!(&model.expert_ids(l as usize).unwrap(), want, "{case} L{l}");
                for r in ROLES {
                    check_role(&model, &path, l, r, want, E, &case);
                }
            }
            assert!(model.verify(&checkpoint).unwrap().verified(), "{case}");
        }
    }
}

/// A share slice `rows:k/n` of every expert role (alone, and with held experts): the
/// roles are cut, so `role_major(3)` is refused by name and no role tensor gives a run
/// other than the file's; each held expert's piece of each role is rows `k·I/n` for
/// `I/n` of that expert's own `I` rows, cut here from the file.
#[test]
fn a_sliced_share_of_dbrx_gives_each_experts_rows_k_of_n() {
    use numapin::model::TensorSlice;
    const I: usize = 256;
    let dir = scratch("share_slice");
    let r = ("BF16", vec![(E * I) as u64, 8]);
    let path = dbrx(&dir, E as u64, [r.clone(), r.clone(), r]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let row = 8 * 2;
    for (k, n) in [(0usize, 2usize), (1, 2), (3, 4), (0, 1)] {
        let slice = TensorSlice::parse(&format!("rows:{k}/{n}")).unwrap();
        for held in [None, Some(vec![1, 2]), Some(vec![0, 3])] {
            let mut share = Share::default().slice(slice);
            if let Some(ids) = &held {
                share = share.experts(ExpertShare::list(ids.iter().copied()).unwrap());
            }
            let case = format!("rows:{k}/{n} held {held:?}");
            let plan = base().share(share);
            if n > 1 {
                match checkpoint.place(&plan, options().role_major(3)) {
                    Err(e) => assert!(e.to_string().contains("role_major"), "{case}: {e}"),
                    Ok(_) => panic!("{case}: role_major(3) placed over cut roles"),
                }
            }
            let model = checkpoint
                .place(&plan, options())
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            let ids = held.clone().unwrap_or_else(|| (0..E).collect());
            for l in 0..2u64 {
                for x in ROLES {
                    let name = role(l, x);
                    let (_, bytes) = file_tensor(&path, &name);
                    if let Some(run) = model.tensor(&name).unwrap().bytes() {
                        // Only an uncut share of consecutive ids is a run: their rows.
                        let per = I * row;
                        let (a, b) = (ids[0] * per, (ids[ids.len() - 1] + 1) * per);
                        assert!(n == 1 && run == &bytes[a..b], "{case} {name}: a run");
                    }
                    for e in 0..E {
                        let got = model.expert(l as usize, e);
                        if !ids.contains(&e) {
                            assert!(got.is_err(), "{case} E{e} not held");
                            continue;
                        }
                        let pieces = got.unwrap();
                        let p = pieces.iter().find(|p| p.tensor == name).unwrap();
                        let a = (e * I + k * I / n) * row;
                        let want = &bytes[a..a + I / n * row];
                        assert!(p.bytes == want, "{case} {name} E{e}: not rows {k}/{n}");
                    }
                }
            }
            assert!(model.verify(&checkpoint).unwrap().verified(), "{case}");
        }
    }
}

/// Files of 1, 2, 3 and 8 experts per layer (DBRX-like, 1 KiB pieces): every share above
/// of that many, the same comparisons.
#[test]
fn other_expert_counts_are_the_files_rows_or_refused() {
    for count in [1usize, 2, 3, 8] {
        let dir = scratch(&format!("share_count_{count}"));
        let r = ("BF16", vec![count as u64 * 64, 8]);
        let path = dbrx(&dir, count as u64, [r.clone(), r.clone(), r]);
        attack_with(&path, &format!("{count} experts"), options(), count);
    }
}
