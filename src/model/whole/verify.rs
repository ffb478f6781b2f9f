//! The check of a placed model against its files ([`PlacedModel::verify`]): every placed
//! tensor, every copy, re-read in the load's read mode, a class at a time, with many reads
//! in flight and compared in place ([`compare`](crate::source::compare)).

use std::collections::HashMap;

use super::classes::TensorClass;
use super::measure::{add_nanos, read_held, slice_fault};
use super::report::WholeVerify;
use super::views::{Place, PlacedModel};
use crate::error::{Error, Result, quote};
use crate::model::{Checkpoint, VerifyReport};
use crate::node::Node;
use crate::source::ReadMode;
use crate::source::compare::{Buffers, Compare, Difference, compare, threads};
use crate::source::load::Reader;
use crate::store::PinStore;

impl PlacedModel {
    /// Re-reads every placed tensor from the files and compares it with every copy of it
    /// (each replica of a replicated class); the routed experts as
    /// [`Checkpoint::verify_with`] does (each slot's pieces, padding zero). The reads are
    /// made in the load's read mode ([`PlacedModel::read_mode`]).
    ///
    /// # Errors
    /// `checkpoint` is not the one placed (its tensor names differ); a read fails; a
    /// store read fails.
    pub fn verify(&self, checkpoint: &Checkpoint) -> Result<WholeVerify> {
        self.verify_in_mode(checkpoint, self.read_mode())
    }

    /// The read mode the placement loaded with (its stores'
    /// [`StoreOptions::read_mode`](crate::store::StoreOptions::read_mode)).
    pub fn read_mode(&self) -> ReadMode {
        (self.stores.iter().map(|s| &s.store))
            .chain(self.experts.iter())
            .next()
            .map_or(ReadMode::Auto, PinStore::read_mode)
    }

    /// [`PlacedModel::verify`], re-reading the files in `mode`: [`ReadMode::Direct`] (and
    /// [`ReadMode::Auto`] on files the page cache does not hold) leaves the page cache as
    /// the load left it, where a buffered re-read would cache the whole model. Each
    /// class's ranges are read in windows of up to 32 MiB by a few threads, each window's
    /// direct reads in flight together, and compared with the placed bytes in place.
    ///
    /// # Example
    /// ```no_run
    /// use numapin::model::{Checkpoint, DenseLayout, PlacementPlan};
    /// use numapin::store::{Layout, ReadMode, StoreOptions};
    /// use numapin::NodeSet;
    /// let ckpt = Checkpoint::open("/models/deepseek-v3")?;
    /// let all = NodeSet::allowed()?;
    /// let plan = PlacementPlan::new(Layout::SplitExperts(all), DenseLayout::Replicate(all));
    /// let options = StoreOptions::default().read_mode(ReadMode::Direct);
    /// let placed = ckpt.place(&plan, options)?;
    /// assert_eq!(placed.read_mode(), ReadMode::Direct);
    /// let check = placed.verify_in_mode(&ckpt, ReadMode::Direct)?;
    /// assert_eq!(check.mismatched, 0);
    /// # Ok::<(), numapin::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`PlacedModel::verify`], or the direct-I/O set-up fails (a file system that
    /// cannot do it falls back to buffered reads, as the load does).
    pub fn verify_in_mode(&self, checkpoint: &Checkpoint, mode: ReadMode) -> Result<WholeVerify> {
        let same = checkpoint.tensors().len() == self.tensors.len()
            && checkpoint
                .tensors()
                .iter()
                .zip(&self.tensors)
                .all(|(a, b)| a.name() == b.name && (a.len() == b.len || b.slice.is_some()));
        if !same {
            return Err(Error::invalid(
                "PlacedModel::verify",
                "the checkpoint is not the one placed (its tensors differ)",
            ));
        }
        let mut report = WholeVerify::default();
        let reader = Reader::new(mode, checkpoint.files().iter().map(|f| f.file()))?;
        let buffers = Buffers::default();
        let mut classes: Vec<TensorClass> = Vec::new();
        for t in &self.tensors {
            if matches!(
                t.place,
                Place::Dense { .. } | Place::ExpertPiece { .. } | Place::ExpertRun { .. }
            ) && !classes.contains(&t.class)
            {
                classes.push(t.class);
            }
        }
        // Every class's ranges (the experts' slots' last), read and compared in one pass
        // (no class waits for the slowest window of the one before), each class's
        // share of the pass's wall time as of the threads' time on its bytes.
        let mut dense = Dense::default();
        for (group, &class) in classes.iter().enumerate() {
            let started = std::time::Instant::now();
            self.dense_compares(checkpoint, (class, group), &reader, &mut dense, &mut report)?;
            add_nanos(&mut report, class, started);
        }
        let mut experts = match (&self.experts, &self.expert_plan) {
            (Some(store), Some(plan)) => {
                let started = std::time::Instant::now();
                let tags = (classes.len(), self.tensors.len());
                // Slot by slot as the store holds them (role-major: one piece per slot).
                let slots = super::role_major::role_major_plan(plan, self.roles);
                let check = checkpoint.expert_check(store, &slots, tags)?;
                add_nanos(&mut report, TensorClass::RoutedExperts, started);
                Some((slots, check))
            }
            _ => None,
        };
        classes.push(TensorClass::RoutedExperts);
        if let Some((_, check)) = experts.as_mut() {
            dense.compares.append(&mut check.compares);
        }
        let started = std::time::Instant::now();
        let what = || "verify".to_owned();
        let compared = compare((&reader, &buffers), threads(), dense.compares, &what)?;
        let wall = super::report::nanos_since(started);
        report.reads += compared.reads;
        report.direct = report.direct.plus(compared.direct);
        let busy: u64 = compared.busy.iter().sum::<u64>().max(1);
        for (&class, &nanos) in classes.iter().zip(&compared.busy) {
            let share = u128::from(wall) * u128::from(nanos) / u128::from(busy);
            add(&mut report, class, u64::try_from(share).unwrap_or(u64::MAX));
        }
        let (own, theirs): (Vec<Difference>, Vec<Difference>) = (compared.differences)
            .into_iter()
            .partition(|d| d.tag < self.tensors.len());
        for d in own {
            let t = &self.tensors[d.tag];
            let node = dense
                .nodes
                .get(&d.tag)
                .and_then(|n| n.get(d.copy))
                .copied()
                .flatten();
            let len = t.len as usize;
            mismatch(&mut report, differs(&t.name, node, len, len, d.at));
        }
        if let Some((slots, check)) = experts {
            let mut found = checkpoint.expert_found(&slots, check, theirs);
            if let Some(plan) = &self.expert_plan {
                super::role_major::expert_of_slots(&mut found, plan, self.roles);
            }
            report.experts = Some(found);
        }
        report.class_nanos.retain(|&(_, n)| n > 0);
        report.class_nanos.sort_by_key(|&(class, _)| class);
        reader.finish()?;
        Ok(report)
    }

    /// The ranges of every placed tensor of `class` and every copy of it, to compare with
    /// the files (counted under `group`), into `dense`; a tensor placed converted is read
    /// and compared here.
    fn dense_compares<'a>(
        &'a self,
        checkpoint: &'a Checkpoint,
        (class, group): (TensorClass, usize),
        reader: &Reader<'_>,
        dense: &mut Dense<'a>,
        report: &mut WholeVerify,
    ) -> Result<()> {
        let tensors = self.tensors.iter().zip(checkpoint.tensors()).enumerate();
        for (index, (t, ct)) in tensors {
            if t.class != class
                || !matches!(
                    t.place,
                    Place::Dense { .. } | Place::ExpertPiece { .. } | Place::ExpertRun { .. }
                )
            {
                continue;
            }
            if let Some(why) = slice_fault(ct, t) {
                report.tensors += 1;
                mismatch(report, format!("{}: {why}", t.name));
                continue;
            }
            let file = checkpoint.files().get(t.file).ok_or_else(|| {
                Error::bad_value(
                    "PlacedModel::verify",
                    "a tensor's file",
                    t.file,
                    format!("the checkpoint has {} files", checkpoint.files().len()),
                )
            })?;
            let len = usize::try_from(t.len).map_err(|_| {
                Error::overflow(
                    "PlacedModel::verify",
                    format!("{}: {} bytes", quote(&t.name), t.len),
                )
            })?;
            report.tensors += 1;
            let copies = self.tensor_copies(&t.name)?;
            if let Some(c) = t.converted {
                // The placed copy holds the conversion of the file's bytes: read whole.
                let mut buffer = vec![0u8; len];
                let mut scratch = reader.scratch()?;
                report.reads += read_held(file, t, &mut buffer, (reader, &mut scratch))?;
                let mut converted = Vec::with_capacity(buffer.len() * 2);
                c.apply(&buffer, &mut converted);
                for (node, held) in copies {
                    report.copies += 1;
                    report.bytes += held.len() as u64;
                    if held != &converted[..] {
                        let at = held.iter().zip(&converted).position(|(a, b)| a != b);
                        let at = at.unwrap_or(held.len().min(converted.len()));
                        mismatch(
                            report,
                            differs(&t.name, node, held.len(), converted.len(), at),
                        );
                    }
                }
                continue;
            }
            let (count, stride) = t.rows;
            let per = usize::try_from(t.len / count.max(1)).unwrap_or(usize::MAX);
            // Rows of a column slice (each `stride` after the one before), or one range.
            let (per, stride) = if count <= 1 || per == 0 {
                (len.max(1), 0)
            } else {
                (per, stride)
            };
            let mut good = Vec::new();
            for (node, held) in copies {
                report.copies += 1;
                report.bytes += held.len() as u64;
                if held.len() == len {
                    good.push((node, held));
                } else {
                    let at = held.len().min(len);
                    mismatch(report, differs(&t.name, node, held.len(), len, at));
                }
            }
            if good.is_empty() {
                continue;
            }
            for (r, at) in (0..len).step_by(per).enumerate() {
                let end = (at + per).min(len);
                dense.compares.push(Compare {
                    file: file.file(),
                    offset: t.offset + r as u64 * stride,
                    copies: good.iter().map(|(_, held)| &held[at..end]).collect(),
                    tag: index,
                    at,
                    group,
                });
            }
            dense
                .nodes
                .insert(index, good.into_iter().map(|(node, _)| node).collect());
        }
        Ok(())
    }
}

/// The dense classes' ranges to compare, and per tensor index the nodes of the copies
/// compared (in [`Compare::copies`] order).
#[derive(Default)]
struct Dense<'a> {
    compares: Vec<Compare<'a>>,
    nodes: HashMap<usize, Vec<Option<Node>>>,
}

/// Adds `nanos` to `class`'s verify time.
fn add(report: &mut WholeVerify, class: TensorClass, nanos: u64) {
    match report.class_nanos.iter_mut().find(|(c, _)| *c == class) {
        Some((_, n)) => *n = n.saturating_add(nanos),
        None => report.class_nanos.push((class, nanos)),
    }
}

/// Counts a copy that differs, listing the first [`VerifyReport::MAX_LISTED`].
fn mismatch(report: &mut WholeVerify, text: String) {
    report.mismatched += 1;
    if report.mismatches.len() < VerifyReport::MAX_LISTED {
        report.mismatches.push(text);
    }
}

fn differs(name: &str, node: Option<Node>, held: usize, file: usize, at: usize) -> String {
    format!(
        "{} (copy on node {}): {held} bytes held, {file} in the file, first difference at byte \
         {at}",
        quote(name),
        node.map_or("-".to_owned(), |n| n.0.to_string()),
    )
}
