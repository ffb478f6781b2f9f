//! The map budget: refuse, with the figures, what would cross `vm.max_map_count`.

use super::load;
use super::{LayerSpec, PinStore};
use crate::diag;
use crate::error::{Error, Result};

impl PinStore {
    /// Checks, before loading anything, that `layers` more layers of `spec` fit in the
    /// map budget (`vm.max_map_count`, or
    /// [`StoreOptions::vma_budget`](super::StoreOptions::vma_budget), minus the mappings
    /// this process has now): a model that cannot fit is refused up front instead of
    /// failing mid-load.
    ///
    /// # Errors
    /// [`Error::MapBudget`] naming the mappings needed, left, the limit and the current
    /// count; or the figures cannot be read.
    pub fn check_model_budget(&self, layers: usize, spec: &LayerSpec) -> Result<()> {
        let per_layer = 1 + usize::from(spec.scale_bytes > 0);
        let needed = layers.checked_mul(per_layer).ok_or_else(|| {
            Error::invalid(
                "PinStore::check_model_budget",
                format!("{layers} layers overflow"),
            )
        })?;
        self.check_budget(
            format!("a model of {layers} layers"),
            needed,
            spec.experts * per_layer,
        )
    }

    /// `regions` new mappings, plus room for the loader threads a fill of `jobs` slots
    /// spawns (each needs a few mappings while it runs: a thread that cannot get them
    /// aborts the process, so they are budgeted too).
    pub(super) fn check_budget(&self, what: String, regions: usize, jobs: usize) -> Result<()> {
        let needed =
            regions + load::MAPS_PER_THREAD * load::helpers(self.options.loader_threads, jobs);
        let limit = match self.options.vma_budget {
            Some(budget) => budget,
            None => diag::max_map_count()?,
        };
        let current = diag::map_count()?;
        let available = limit.saturating_sub(current);
        if needed > available {
            return Err(Error::MapBudget {
                what,
                needed,
                available,
                limit,
                current,
            });
        }
        Ok(())
    }
}
