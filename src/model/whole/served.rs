//! A whole placement served by name ([`crate::serve`]): [`PlacedModel::serve`] exports
//! it and serves the parcel, [`PlacedModel::attach_served`] fetches and attaches it, and
//! [`Checkpoint::place_or_attach`] elects the one process that places.

use super::export::ModelManifest;
use super::plan::PlacementPlan;
use super::views::PlacedModel;
use crate::error::{Error, Result};
use crate::model::Checkpoint;
use crate::serve::{Access, Joined, Limits, Parcel, Server, fetch, serve_or_attach};
use crate::store::StoreOptions;

const ATTACH_SERVED: &str = "PlacedModel::attach_served";
const PLACE_OR_ATTACH: &str = "Checkpoint::place_or_attach";

impl PlacedModel {
    /// Exports the placement ([`PlacedModel::export`]: its stores are frozen) and serves
    /// it under `name` until the [`Server`] is dropped. Readers that attached keep their
    /// views after that (they hold the memfds).
    ///
    /// # Errors
    /// Those of [`PlacedModel::export`] (a placement not made with
    /// [`StoreOptions::shared`]) and of [`Server::bind`] (a bad or taken name).
    pub fn serve(&mut self, name: &str, access: Access) -> Result<Server> {
        let export = self.export()?;
        let parcel = Parcel {
            manifest: export.manifest.to_bytes(),
            files: export.files,
        };
        Server::bind(name, parcel, access)
    }

    /// Attaches a placement from a parcel that [`PlacedModel::serve`] (or
    /// [`Checkpoint::place_or_attach`]) served: its manifest parsed, the file count
    /// checked against [`ModelManifest::file_count`], then [`PlacedModel::attach`].
    ///
    /// # Errors
    /// The manifest does not parse ([`ModelManifest::parse`]); the parcel has another
    /// number of files than the manifest describes; those of [`PlacedModel::attach`].
    /// On error every file is closed and nothing stays mapped.
    pub fn attach_parcel(parcel: Parcel) -> Result<PlacedModel> {
        let manifest = ModelManifest::parse(&parcel.manifest)?;
        check_count(&manifest, &parcel)?;
        PlacedModel::attach(&manifest, parcel.files)
    }

    /// Fetches the placement served as `name` ([`fetch`]) and attaches it
    /// ([`PlacedModel::attach_parcel`]): the server's pages, read-only, no copy, no file
    /// read.
    ///
    /// # Errors
    /// Those of [`fetch`] (no server, a refused uid, a bad message, a timeout) and of
    /// [`PlacedModel::attach_parcel`].
    pub fn attach_served(name: &str, limits: &Limits) -> Result<PlacedModel> {
        PlacedModel::attach_parcel(fetch(name, limits)?).map_err(|e| context(e, name))
    }
}

impl Checkpoint {
    /// Joins the placement served as `name` ([`serve_or_attach`]): the first process
    /// places this checkpoint under `plan` (`options` made
    /// [`shared`](StoreOptions::shared), as exporting needs) and serves it, returning
    /// the model and its [`Server`]; every other process waits for it and attaches,
    /// returning the model and `None`. An attached manifest must be of this checkpoint
    /// ([`ModelManifest::check_identity`]: file lengths and header hashes).
    ///
    /// The plan of an attached model is the placer's: `plan` is only used to place.
    ///
    /// # Errors
    /// Those of [`Checkpoint::place`] and [`PlacedModel::export`] in the placer; those
    /// of [`serve_or_attach`]; a served manifest that does not parse or whose file count
    /// differs; a served model of another checkpoint ([`Error::InvalidArgument`] naming
    /// `name` and the first difference), with nothing mapped; those of
    /// [`PlacedModel::attach`].
    pub fn place_or_attach(
        &self,
        name: &str,
        plan: &PlacementPlan,
        options: StoreOptions,
        access: Access,
        limits: &Limits,
    ) -> Result<(PlacedModel, Option<Server>)> {
        let joined = serve_or_attach(name, access, limits, || {
            let mut model = self.place(plan, options.shared(true))?;
            let export = model.export()?;
            let parcel = Parcel {
                manifest: export.manifest.to_bytes(),
                files: export.files,
            };
            Ok((model, parcel))
        })?;
        match joined {
            Joined::Placed { value, server } => Ok((value, Some(server))),
            Joined::Attached(parcel) => {
                let manifest =
                    ModelManifest::parse(&parcel.manifest).map_err(|e| context(e, name))?;
                manifest
                    .check_identity(self)
                    .map_err(|e| within(e, PLACE_OR_ATTACH, name))?;
                check_count(&manifest, &parcel).map_err(|e| context(e, name))?;
                let model =
                    PlacedModel::attach(&manifest, parcel.files).map_err(|e| context(e, name))?;
                Ok((model, None))
            }
        }
    }
}

/// A named error unless the parcel holds as many files as the manifest describes.
fn check_count(manifest: &ModelManifest, parcel: &Parcel) -> Result<()> {
    if parcel.files.len() != manifest.file_count() {
        return Err(Error::mismatch(
            ATTACH_SERVED,
            "files in the served parcel, one per region of its manifest",
            manifest.file_count(),
            parcel.files.len(),
        ));
    }
    Ok(())
}

/// `e`, unchanged in kind; an invalid argument also names the served `name`.
fn context(e: Error, name: &str) -> Error {
    within(e, ATTACH_SERVED, name)
}

/// `e`, unchanged in kind; an invalid argument (its detail's variant and figures kept)
/// becomes `op`'s, naming the operation that refused it and the served `name`.
fn within(e: Error, op: &'static str, name: &str) -> Error {
    match e {
        Error::InvalidArgument { op: inner, reason } => Error::InvalidArgument {
            op,
            reason: reason.within(&format!(
                "{inner} of the model served as {:?}",
                crate::error::clip(name, 80).0
            )),
        },
        e => e,
    }
}
