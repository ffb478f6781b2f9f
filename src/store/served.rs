//! A store served by name ([`crate::serve`]): the export as a parcel, and a store
//! attached from one.

use super::PinStore;
use super::manifest::Manifest;
use super::shared::Export;
use crate::error::{Error, Result};
use crate::serve::{Access, Limits, Parcel, Server, fetch};

impl Export {
    /// The export as a [`Parcel`] to serve: the manifest's text and the files.
    pub fn into_parcel(self) -> Parcel {
        Parcel {
            manifest: self.manifest.to_text().into_bytes(),
            files: self.files,
        }
    }
}

impl PinStore {
    /// Exports the store ([`PinStore::export`]: it is frozen) and serves it under `name`
    /// until the [`Server`] is dropped (see [`crate::serve`]).
    ///
    /// # Errors
    /// Those of [`PinStore::export`] and [`Server::bind`].
    pub fn serve(&mut self, name: &str, access: Access) -> Result<Server> {
        Server::bind(name, self.export()?.into_parcel(), access)
    }

    /// Attaches a store from a parcel that an [`Export::into_parcel`] made: its
    /// manifest parsed, then [`PinStore::attach`].
    ///
    /// # Errors
    /// The manifest is not UTF-8 or does not parse; those of [`PinStore::attach`].
    pub fn attach_parcel(parcel: Parcel) -> Result<PinStore> {
        let text = std::str::from_utf8(&parcel.manifest).map_err(|e| {
            Error::invalid(
                "PinStore::attach_parcel",
                format!("the manifest is not UTF-8: {e}"),
            )
        })?;
        PinStore::attach(&Manifest::parse(text)?, parcel.files)
    }

    /// Fetches the store served as `name` ([`fetch`]) and attaches it: the same pages
    /// as the server's, read-only, no copy.
    ///
    /// # Errors
    /// Those of [`fetch`] and [`PinStore::attach_parcel`].
    pub fn attach_served(name: &str, limits: &Limits) -> Result<PinStore> {
        PinStore::attach_parcel(fetch(name, limits)?)
    }
}
