//! Role-major expert slots in a whole placement (issue 33 item 5): where a framework
//! keeps each role of a layer's experts as one tensor (DBRX's `w1`/`v1`/`w2`,
//! `[E·I, H]` each), the experts' store holds role `r` of expert `e` in slot
//! `r × E + e` ([`StoreOptions::role_major`]), so each role's experts lie back to back
//! and the tensor is one run of bytes in the file's layout. Chosen for a checkpoint whose
//! expert tensors are flattened per role (DBRX) and for a caller who asks
//! (`role_major(R)`, `R` the layer's weight roles); refused by name where it cannot keep
//! its promise.

use super::assign::Assigned;
use super::plan::PlacementPlan;
use super::views::{Place, PlacedTensor};
use crate::error::{Error, Result};
use crate::model::{Checkpoint, ExpertPieces, ExpertPlan, LayerPlan};
use crate::store::{Kind, PinStore, StoreOptions};

const OP: &str = "Checkpoint::place";

/// The role-major runs of the placement's experts: `options.role_major` where asked
/// (above 1), checked against the plan; otherwise the weight roles of a checkpoint whose
/// expert tensors are flattened per role (DBRX), where nothing else orders the slots;
/// 1 (a slot per expert) for everything else. A shared store's export carries the
/// order (the manifest's `roles`, each run's place): an attached model gives the same
/// runs ([`check_attached`]).
///
/// Under a share that holds its experts whole (`experts_held`, or a tensor-parallel
/// plan that keeps the routed experts whole): slot `r × E_held + i` holds role `r` of
/// the `i`-th held expert, so each role of the held experts is one run. A share that
/// cuts an expert role (tensor-parallel rows or columns) stays a slot per expert: its
/// cut pieces of a role are no run of the file's tensor.
///
/// # Errors
/// Role-major asked with a share that cuts an expert role, an expert assignment, a
/// layer with scales, or `R` other than a layer's weight roles
/// ([`Error::InvalidArgument`] naming `role_major`).
pub(super) fn roles_for(
    checkpoint: &Checkpoint,
    assigned: &Assigned,
    plan: &PlacementPlan,
    options: &StoreOptions,
) -> Result<usize> {
    let asked = options.role_major;
    let bad = |why: String| Error::bad_value(OP, "role_major", asked, why);
    if asked == 0 {
        return Err(bad("a slot order needs at least 1 role".into()));
    }
    let Some(experts) = assigned.experts.as_ref() else {
        return Ok(1); // no routed experts: nothing to order
    };
    let weights = uniform_roles(experts);
    if asked == 1 {
        let auto = weights.filter(|_| {
            !cuts(experts) && options.assignment.is_none() && flattened(checkpoint, experts)
        });
        return Ok(auto.unwrap_or(1));
    }
    if plan.share.is_some() && cuts(experts) {
        return Err(bad(
            "role-major slots under a share that cuts the experts' roles (tensor \
             parallel): the cut pieces of a role are no run of the file's tensor; a share \
             holding whole experts (experts_held) takes role-major slots"
                .into(),
        ));
    }
    if options.assignment.is_some() {
        return Err(bad(
            "role-major slots with an expert assignment: it orders the slots node by node".into(),
        ));
    }
    match weights {
        Some(w) if w == asked => Ok(asked),
        Some(w) => Err(bad(format!(
            "the experts have {w} weight roles per layer: role-major slots hold one role \
             of one expert each (role_major({w}))"
        ))),
        None => Err(bad(
            "every MoE layer needs the same weight roles, one piece each, and no scale \
             slot: a role-major slot holds one piece"
                .into(),
        )),
    }
}

/// Whether a share cuts some expert role of some layer (a tensor-parallel slice that is
/// not whole).
fn cuts(plan: &ExpertPlan) -> bool {
    plan.layers()
        .iter()
        .filter_map(|l| l.share())
        .any(|s| s.slices().iter().any(|c| !c.whole))
}

/// The weight roles every layer has, where every expert has one piece per role and no
/// scales (what a role-major slot holds); `None` otherwise (and where no layer holds an
/// expert: a rank given none has no run to order).
fn uniform_roles(plan: &ExpertPlan) -> Option<usize> {
    let first = plan
        .layers()
        .iter()
        .find_map(|l| l.experts().first())?
        .weights()
        .len();
    let uniform = plan.layers().iter().all(|l| {
        l.scale_bytes() == 0
            && l.experts()
                .iter()
                .all(|e| e.weights().len() == first && e.scales().is_empty())
    });
    (uniform && first > 1).then_some(first)
}

/// Whether a weight tensor holds every expert of its layer flattened per role: `E`
/// pieces of it, its outermost dimension `E × k` with `k > 1` (DBRX's `[E·I, H]`), not
/// `E` (`[E, I, H]`, GGUF's `ffn_*_exps`, a view of slots already).
fn flattened(checkpoint: &Checkpoint, plan: &ExpertPlan) -> bool {
    plan.layers().iter().any(|l| {
        // Under a share, the checkpoint's experts (the tensor holds every one).
        let experts = l.share().map_or(l.experts().len(), |s| s.of()) as u64;
        l.experts().first().is_some_and(|e| {
            e.weights().iter().any(|p| {
                let t = &checkpoint.tensors()[p.tensor()];
                let shape = super::shape::normalized_shape(t);
                experts > 1
                    && t.len() == p.len().saturating_mul(experts)
                    && shape
                        .first()
                        .is_some_and(|&d| d != experts && d % experts == 0)
            })
        })
    })
}

/// `plan` in role-major slot order: each layer's `R × E` slots, slot `r × E + e` holding
/// weight piece `r` of expert `e` alone (what the store packs and verify compares).
/// Under a share, `E` is the experts held and `e` the held one's index: the slots are
/// the store's own, without the share's global ids (a role-major store is looked up by
/// slot).
pub(crate) fn role_major_plan(plan: &ExpertPlan, roles: usize) -> ExpertPlan {
    if roles <= 1 {
        return plan.clone();
    }
    let mut out = plan.clone();
    out.layers = plan
        .layers()
        .iter()
        .map(|l| role_major_layer(l, roles))
        .collect();
    out
}

fn role_major_layer(l: &LayerPlan, roles: usize) -> LayerPlan {
    let mut out = l.clone();
    out.share = None;
    out.experts = (0..roles)
        .flat_map(|r| {
            l.experts().iter().map(move |e| ExpertPieces {
                weights: e.weights().get(r).copied().into_iter().collect(),
                scales: Vec::new(),
            })
        })
        .collect();
    out.weight_bytes = out
        .experts
        .iter()
        .flat_map(|e| e.weights())
        .map(|p| p.len())
        .max()
        .unwrap_or(0);
    out
}

/// Role-major verify compares slot by slot ([`role_major_plan`]): a mismatch found at
/// slot `r × E + e` is expert `e`'s (its role `r`), as [`SlotMismatch::expert`] says.
///
/// [`SlotMismatch::expert`]: crate::model::SlotMismatch::expert
pub(crate) fn expert_of_slots(
    report: &mut crate::model::VerifyReport,
    plan: &ExpertPlan,
    roles: usize,
) {
    if roles <= 1 {
        return;
    }
    for m in &mut report.mismatches {
        let Some(l) = plan.layers().iter().find(|l| l.layer() == m.layer) else {
            continue;
        };
        let experts = l.experts().len();
        if experts == 0 {
            continue;
        }
        let (r, e) = (m.expert / experts, m.expert % experts);
        m.reason = format!("role {r} (role-major slot {}): {}", m.expert, m.reason);
        m.expert = l.expert_id(e); // under a share, the held expert's global id
    }
}

/// The store slot of weight piece `piece` of expert `expert` (of `experts`), and the
/// piece's index in that slot: `(expert, piece)` a slot per expert, `(piece × E +
/// expert, 0)` role-major.
pub(crate) fn slot_of(roles: usize, experts: usize, expert: usize, piece: usize) -> (usize, usize) {
    if roles <= 1 {
        (expert, piece)
    } else {
        (piece.saturating_mul(experts).saturating_add(expert), 0)
    }
}

/// Under role-major slots, each tensor holding every expert of a layer whose role's run
/// is back to back in the slots (each slot exactly its piece, in the file's order):
/// [`Place::ExpertRun`], one run of bytes with the file's layout. Under a share holding
/// experts `a..a + n` of `E` (consecutive ids), the run is the tensor's rows
/// `a × rows / E` for `n × rows / E` (its [`DenseSlice`], shape and file range say so);
/// held ids with a gap are no rows of the tensor, and it stays [`Place::Experts`].
///
/// [`DenseSlice`]: super::shape::DenseSlice
pub(crate) fn role_runs(
    store: &PinStore,
    plan: &ExpertPlan,
    roles: usize,
    tensors: &mut [PlacedTensor],
) -> Result<()> {
    if roles <= 1 {
        return Ok(());
    }
    for l in plan.layers() {
        let experts = l.experts().len();
        let Some(first) = l.experts().first() else {
            continue;
        };
        let ids: Vec<usize> = (0..experts).map(|i| l.expert_id(i)).collect();
        let consecutive = ids.windows(2).all(|w| w[1] == w[0].wrapping_add(1));
        let map = store.slot_map(l.layer())?;
        for (r, p) in first.weights().iter().enumerate() {
            let t = p.tensor();
            // Every held expert's piece r of the same tensor, in expert order, back to
            // back in the file and in their slots (each at offset 0, its whole length).
            let in_order = consecutive
                && l.experts().iter().enumerate().all(|(e, x)| {
                    let (slot, _) = slot_of(roles, experts, e, r);
                    let piece = x.weights().get(r);
                    let placed = map.pieces(slot, Kind::Weights).unwrap_or_default();
                    piece.is_some_and(|q| {
                        q.tensor() == t
                            && q.offset() == p.offset().saturating_add(q.len() * e as u64)
                            && placed.len() == 1
                            && placed[0].offset == 0
                            && placed[0].len as u64 == q.len()
                    })
                });
            let Some(placed) = tensors.get_mut(t) else {
                continue;
            };
            if !in_order || placed.place != Place::Experts {
                continue;
            }
            let of = l.share().map_or(experts, |s| s.of()) as u64;
            let held = p.len().saturating_mul(experts as u64);
            if placed.len != p.len().saturating_mul(of) {
                continue;
            }
            if held != placed.len {
                // A share's held experts: rows of the tensor.
                let Some(&rows) = placed.shape.first() else {
                    continue;
                };
                let (per, a) = (rows / of.max(1), ids[0] as u64);
                placed.slice = Some(super::shape::DenseSlice {
                    axis: crate::model::SliceAxis::Rows,
                    start: a * per,
                    len: experts as u64 * per,
                    extent: rows,
                });
                placed.shape[0] = experts as u64 * per;
                placed.offset = p.offset();
                placed.len = held;
                placed.rows = (1, 0);
            }
            placed.place = Place::ExpertRun {
                layer: l.layer(),
                first: r * experts,
                count: experts,
            };
        }
    }
    Ok(())
}

/// An attached placement's role-major order, checked against its manifest's own plan
/// and store: `roles` at least 1; above 1, the experts' store is role-major with the same
/// count and every MoE layer has `roles × E` slots (`E` its experts held), each expert
/// one weight piece per role and no scales; each [`Place::ExpertRun`] is role `r <
/// roles` of a layer (`first = r × E`, `count = E`), the run's pieces (role `r` of every
/// expert) that tensor's, back to back, its length theirs. A forged manifest is refused
/// by name, before any view is made.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `roles` or the tensor.
pub(crate) fn check_attached(
    roles: usize,
    tensors: &[PlacedTensor],
    plan: Option<&ExpertPlan>,
    store: Option<&PinStore>,
) -> Result<()> {
    const ATTACH: &str = "PlacedModel::attach";
    let bad = |why: String| Error::bad_value(ATTACH, "roles", roles, why);
    if roles == 0 {
        return Err(bad("a slot order needs at least 1 role".into()));
    }
    if let Some(store) = store
        && store.role_major() != roles
    {
        return Err(bad(format!(
            "the experts' store is role-major x{}",
            store.role_major()
        )));
    }
    if roles > 1 {
        let (Some(plan), Some(store)) = (plan, store) else {
            return Err(bad(
                "role-major slots without an expert plan and store".into()
            ));
        };
        for l in plan.layers() {
            let slots = store.slot_map(l.layer())?.experts();
            let uniform = l
                .experts()
                .iter()
                .all(|e| e.weights().len() == roles && e.scales().is_empty());
            if !uniform || Some(slots) != roles.checked_mul(l.experts().len()) {
                return Err(bad(format!(
                    "layer {}: {slots} slots for {} experts, each needing {roles} weight \
                     pieces and no scales",
                    l.layer(),
                    l.experts().len()
                )));
            }
        }
    }
    for (index, t) in tensors.iter().enumerate() {
        let Place::ExpertRun {
            layer,
            first,
            count,
        } = t.place
        else {
            continue;
        };
        let l = plan.and_then(|p| p.layer(layer)).filter(|_| roles > 1);
        let run = l.and_then(|l| {
            let r = first.checked_div(count)?;
            let pieces: Vec<_> = l.experts().iter().map(|e| e.weights().get(r)).collect();
            let pieces: Option<Vec<_>> = pieces.into_iter().collect();
            let pieces = pieces?;
            let len = pieces
                .iter()
                .try_fold(0u64, |a, p| a.checked_add(p.len()))?;
            let ok = count == l.experts().len()
                && first == r * count
                && r < roles
                && len == t.len
                && super::shape::shape_bytes(t.dtype, &t.shape) == Some(t.len)
                && run_slice_agrees(t, l)
                && pieces.iter().all(|p| p.tensor() == index)
                && pieces
                    .windows(2)
                    .all(|w| w[0].offset().checked_add(w[0].len()) == Some(w[1].offset()));
            ok.then_some(())
        });
        if run.is_none() {
            return Err(Error::bad_value(
                ATTACH,
                "a role-major run",
                format!("{} (layer {layer}, slots {first}+{count})", t.name),
                format!(
                    "not one role of the layer's experts under role_major({roles}), its \
                     shape {:?} of {} its {} bytes",
                    t.shape, t.dtype, t.len
                ),
            ));
        }
    }
    Ok(())
}

/// Whether a run's slice says which rows of the tensor it holds, as [`role_runs`] made
/// it: none where the run holds every expert of the layer; under a share, rows
/// `a × rows / E` for `n × rows / E` of the tensor's `rows` (held ids `a..a + n`,
/// consecutive), its shape's outermost axis that many. A forged slice (or one dropped)
/// would name other rows than the run gives.
fn run_slice_agrees(t: &PlacedTensor, l: &crate::model::LayerPlan) -> bool {
    let n = l.experts().len();
    let of = l.share().map_or(n, |s| s.of());
    let Some(slice) = t.slice else {
        return n == of;
    };
    let ids: Vec<usize> = (0..n).map(|i| l.expert_id(i)).collect();
    let consecutive = ids.windows(2).all(|w| Some(w[1]) == w[0].checked_add(1));
    let (Some(&a), Ok(of)) = (ids.first(), u64::try_from(of)) else {
        return false;
    };
    let per = slice
        .extent
        .checked_div(of)
        .filter(|_| slice.extent % of == 0);
    let want = per.and_then(|per| Some((per.checked_mul(a as u64)?, per.checked_mul(n as u64)?)));
    consecutive
        && l.share().is_some_and(|s| n < s.of())
        && slice.axis == crate::model::SliceAxis::Rows
        && want == Some((slice.start, slice.len))
        && t.shape.first() == Some(&slice.len)
}
