//! A whole placement shared with other processes: [`PlacedModel::export`] freezes every
//! store (experts, shares and slices, replicas, domains, hybrid hot copies: each region
//! a sealed memfd) and describes them in a [`ModelManifest`]; [`PlacedModel::attach`]
//! maps them read-only in another process and rebuilds the same views, each reader
//! reading its own node's copy, with no file read and no copy.
//!
//! The manifest's text ([`ModelManifest::to_bytes`]) is a header line
//! `numapin-model 2\n` then one JSON object, parsed strictly
//! ([`ModelManifest::parse`]): unknown and duplicate keys are refused by name, the size
//! is bounded ([`MAX_MANIFEST_BYTES`]), numbers must fit their type, and every index a
//! view follows (a tensor of an expert piece, a dense store, a file) is checked before
//! anything is mapped. It carries an identity of the checkpoint (each file's length and
//! a hash of its header bytes, before its first tensor) so that
//! [`PlacedModel::attach_checked`] refuses a manifest made for another model.

use std::collections::HashMap;
use std::fs::File;

use serde::{Deserialize, Serialize};

use super::identity::Identity;
use super::views::{DenseStore, PlacedModel};
use super::wire::{self, ATTACH, PlanPart, TensorPart};
use crate::error::{Error, Result};
use crate::model::{Checkpoint, Naming};
use crate::store::{PinStore, StorePart};

/// The manifest's header line (format and version), before the JSON body.
/// Version 2 added the expert naming (a preset's name); a version-1 manifest is refused
/// as "unsupported version".
pub const MODEL_MANIFEST_HEADER: &str = "numapin-model 2";

/// The largest manifest [`ModelManifest::parse`] reads (64 MiB: a 1000-layer model
/// with 256 experts a layer is a few MiB).
pub const MAX_MANIFEST_BYTES: usize = 64 << 20;

const EXPORT: &str = "PlacedModel::export";
const PARSE: &str = "ModelManifest::parse";

/// What [`PlacedModel::export`] hands out: the manifest and the sealed memfds, in the
/// manifest's order (close on exec; clear that flag on the ones a child inherits).
#[derive(Debug)]
pub struct ModelExport {
    /// What a reader needs to rebuild the views.
    pub manifest: ModelManifest,
    /// One sealed memfd per region of every copy of every store.
    pub files: Vec<File>,
}

/// The whole manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    identity: Identity,
    /// File descriptors the export hands out.
    files: usize,
    tensors: Vec<TensorPart>,
    expert_plan: Option<PlanPart>,
    /// Per dense store: its class's name and the store.
    dense: Vec<(String, StorePart)>,
    experts: Option<StorePart>,
    /// [`StoreOptions::role_major`](crate::store::StoreOptions::role_major) of the
    /// experts' slots; absent (1) in a manifest written before role-major exports.
    #[serde(default = "one_role")]
    roles: usize,
    /// The expert naming's name where it is a preset ([`Naming::PRESETS`]); `None`
    /// without experts or for a custom naming (its rules are code: they cannot cross
    /// processes).
    naming: Option<String>,
}

fn one_role() -> usize {
    1
}

/// The preset called `name`.
fn preset(name: &str) -> Option<Naming> {
    Naming::PRESETS.into_iter().find(|n| n.name() == name)
}

/// What a reader needs to rebuild a placed model's views from its exported memfds:
/// tensor names, classes, dtypes, shapes, slices and places, the expert plan (pieces,
/// roles, a share's expert ids and slices), and per store each layer's copies (node,
/// regions, loaded bytes per slot, slot order), share ids and slot map; with the
/// checkpoint's identity. Versioned ([`MODEL_MANIFEST_HEADER`]).
///
/// # Example
/// ```no_run
/// use numapin::model::{Checkpoint, ModelManifest, PlacedModel};
/// use numapin::store::StoreOptions;
/// use numapin::NodeSet;
///
/// let checkpoint = Checkpoint::open("/models/qwen3-30b-a3b")?;
/// let plan = checkpoint.default_plan(NodeSet::allowed()?)?;
/// let mut model = checkpoint.place(&plan, StoreOptions::default().shared(true))?;
/// let export = model.export()?;
/// let bytes = export.manifest.to_bytes(); // to the reader, with the files
/// // In the reader:
/// let manifest = ModelManifest::parse(&bytes)?;
/// let attached = PlacedModel::attach(&manifest, export.files)?;
/// println!("{} tensors", attached.len());
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelManifest {
    body: Body,
}

impl ModelManifest {
    /// The text form: [`MODEL_MANIFEST_HEADER`], a newline, one JSON object.
    /// [`ModelManifest::parse`] reads it back equal.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!("{MODEL_MANIFEST_HEADER}\n").into_bytes();
        // Plain structs, strings and numbers: serializing them cannot fail.
        if let Ok(json) = serde_json::to_vec(&self.body) {
            out.extend_from_slice(&json);
        }
        out
    }

    /// Parses [`ModelManifest::to_bytes`] strictly.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`]: more than [`MAX_MANIFEST_BYTES`]; a missing or other
    /// header (another version is named); a body that is not the JSON `to_bytes` writes
    /// (serde names the unknown or duplicate key, the missing field, the number that
    /// does not fit, the place a truncated body ends); a tensor named twice; an expert
    /// naming that is not a preset's name, or not the expert plan's. Typed:
    /// [`Invalid::TooLarge`](crate::Invalid::TooLarge) for the size, else
    /// [`Invalid::BadValue`](crate::Invalid::BadValue) with `what` `"manifest header"`,
    /// `"manifest body"`, `"tensor name"` or `"expert naming"`.
    pub fn parse(bytes: &[u8]) -> Result<ModelManifest> {
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(Error::too_large(
                PARSE,
                "the manifest",
                bytes.len(),
                MAX_MANIFEST_BYTES,
                "MAX_MANIFEST_BYTES",
            ));
        }
        let newline = bytes.iter().position(|&b| b == b'\n');
        let (header, body) = match newline {
            Some(n) => (&bytes[..n], &bytes[n + 1..]),
            None => (bytes, &[][..]),
        };
        if header != MODEL_MANIFEST_HEADER.as_bytes() || newline.is_none() {
            let text = String::from_utf8_lossy(header);
            let (head, _) = crate::error::clip(&text, 80);
            let why = if newline.is_none() && header.starts_with(b"numapin-model ") {
                "the header line does not end with a newline (truncated?)".to_owned()
            } else if header.starts_with(b"numapin-model ") {
                format!("unsupported version (this crate reads {MODEL_MANIFEST_HEADER:?})")
            } else {
                format!(
                    "not a numapin model manifest (expected {MODEL_MANIFEST_HEADER:?} and a newline)"
                )
            };
            return Err(Error::bad_value(
                PARSE,
                "manifest header",
                format!("{head:?}"),
                why,
            ));
        }
        let body: Body = serde_json::from_slice(body).map_err(|e| {
            Error::bad_value(
                PARSE,
                "manifest body",
                format!("of {} bytes", body.len()),
                e.to_string(),
            )
        })?;
        if let Some(n) = body.naming.as_deref().filter(|n| preset(n).is_none()) {
            return Err(Error::bad_value(
                PARSE,
                "expert naming",
                crate::error::quote(n),
                "not the name of a preset (Naming::PRESETS)",
            ));
        }
        if let Some(n) = body.naming.as_deref() {
            let plan = body.expert_plan.as_ref().map(wire::PlanPart::naming);
            if plan != Some(n) {
                return Err(Error::bad_value(
                    PARSE,
                    "expert naming",
                    crate::error::quote(n),
                    match plan {
                        Some(p) => {
                            format!("the expert plan's naming is {}", crate::error::quote(p))
                        }
                        None => "the manifest has no expert plan".to_owned(),
                    },
                ));
            }
        }
        let mut names = std::collections::HashSet::new();
        if let Some(t) = body.tensors.iter().find(|t| !names.insert(t.name.as_str())) {
            return Err(Error::bad_value(
                PARSE,
                "tensor name",
                crate::error::quote(&t.name),
                "appears twice",
            ));
        }
        Ok(ModelManifest { body })
    }

    /// The file descriptors the manifest describes (what [`PlacedModel::attach`] needs).
    pub fn file_count(&self) -> usize {
        self.body.files
    }

    /// Tensors it describes.
    pub fn tensor_count(&self) -> usize {
        self.body.tensors.len()
    }

    /// Whether it was made from `checkpoint` (the same file lengths and header hashes).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] ([`Invalid::BadValue`](crate::Invalid::BadValue), what
    /// `"manifest"`) naming the first difference; a file's header cannot be read.
    pub fn check_identity(&self, checkpoint: &Checkpoint) -> Result<()> {
        self.body.identity.check(checkpoint)
    }
}

impl PlacedModel {
    /// Freezes every store of the placement and hands out their sealed memfds and a
    /// manifest, for other processes to [`PlacedModel::attach`]. The placement must
    /// have been made with [`StoreOptions::shared`](crate::store::StoreOptions::shared)
    /// (memfd-backed); afterwards its stores are frozen ([`PinStore::export`]'s rules:
    /// reads work, changes answer [`Error::Frozen`]). Exporting again hands out the same
    /// files.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] ([`Invalid::WrongBacking`](crate::Invalid::WrongBacking))
    /// for a placement not made shared, naming the store; freezing, sealing or
    /// duplicating fails (as [`PinStore::export`]).
    pub fn export(&mut self) -> Result<ModelExport> {
        let identity = self.identity.clone().ok_or_else(|| {
            Error::wrong_backing(
                EXPORT,
                "a placement that is not memfd-backed",
                "a placement made with StoreOptions::shared(true)",
            )
        })?;
        let mut files = Vec::new();
        let mut dense = Vec::with_capacity(self.stores.len());
        for s in &mut self.stores {
            let part = s
                .store
                .export_part(&mut files)
                .map_err(|e| with_store(e, &format!("the {} store", s.class.name())))?;
            dense.push((s.class.name().to_owned(), part));
        }
        let experts = match &mut self.experts {
            Some(store) => Some(
                store
                    .export_part(&mut files)
                    .map_err(|e| with_store(e, "the expert store"))?,
            ),
            None => None,
        };
        let body = Body {
            identity,
            files: files.len(),
            tensors: self.tensors.iter().map(wire::tensor_part).collect(),
            expert_plan: self.expert_plan.as_ref().map(wire::plan_part),
            dense,
            experts,
            naming: self
                .naming
                .as_ref()
                .filter(|n| !matches!(n, Naming::Custom(_)))
                .map(|n| n.name().to_owned()),
            roles: self.roles,
        };
        Ok(ModelExport {
            manifest: ModelManifest { body },
            files,
        })
    }

    /// Maps an exported placement read-only: the same pages as the exporter's, no file
    /// read, no copy. [`PlacedModel::tensor`], [`PlacedModel::expert`],
    /// [`PlacedModel::expert_ids`], [`PlacedModel::tensors`] and
    /// [`PlacedModel::tensor_copies`] answer as in the exporter; a replicated class or
    /// expert layer is read from the copy on the calling thread's node (or the nearest).
    /// [`PlacedModel::naming`] is the placer's where it is a preset (a custom naming's
    /// rules are code and cannot cross processes: `None`); [`PlacedModel::report`] is
    /// `None` (it measures the placer's loads, which a reader did not make).
    ///
    /// Every file must be a memfd sealed `F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW`
    /// and at least as long as the manifest says (the kernel then guarantees that no
    /// process can change what the views hand out).
    ///
    /// # Errors
    /// A file count other than [`ModelManifest::file_count`]; a file that is not a
    /// sealed memfd or is shorter than its region; indices out of range (a dense store,
    /// a tensor of an expert piece, a file used twice or not at all); a layout or
    /// region that does not parse; mapping fails. On error nothing stays mapped and
    /// every file is closed.
    pub fn attach(manifest: &ModelManifest, files: Vec<File>) -> Result<PlacedModel> {
        let body = &manifest.body;
        if files.len() != body.files {
            return Err(Error::mismatch(
                ATTACH,
                "files, one per region of the manifest",
                body.files,
                files.len(),
            ));
        }
        let mut files: Vec<Option<File>> = files.into_iter().map(Some).collect();
        let mut tensors = Vec::with_capacity(body.tensors.len());
        for t in &body.tensors {
            tensors.push(wire::placed_tensor(t, body.dense.len())?);
        }
        let expert_plan = match &body.expert_plan {
            Some(p) => Some(wire::expert_plan(
                p,
                tensors.len(),
                &body.identity.file_lengths(),
            )?),
            None => None,
        };
        let mut stores = Vec::with_capacity(body.dense.len());
        for (class, part) in &body.dense {
            let class = super::TensorClass::from_name(class).ok_or_else(|| {
                Error::bad_value(ATTACH, "store class", crate::error::quote(class), "unknown")
            })?;
            stores.push(DenseStore {
                class,
                store: PinStore::attach_part(part, &mut files)?,
                reads: 0,
                bounced: 0,
                load_nanos: 0,
                files: Vec::new(),
                // An attached store read nothing.
                direct: crate::source::DirectReads::default(),
            });
        }
        let experts = match &body.experts {
            Some(part) => Some(PinStore::attach_part(part, &mut files)?),
            None => None,
        };
        if let Some(unused) = files.iter().position(Option::is_some) {
            return Err(Error::bad_value(
                ATTACH,
                "file index",
                unused,
                "no region of the manifest names it",
            ));
        }
        super::role_major::check_attached(
            body.roles,
            &tensors,
            expert_plan.as_ref(),
            experts.as_ref(),
        )?;
        let by_name: HashMap<String, usize> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(PlacedModel {
            tensors,
            by_name,
            stores,
            experts,
            expert_load_nanos: 0,
            expert_files: Vec::new(),
            expert_reads: crate::source::DirectReads::default(),
            expert_plan,
            roles: body.roles,
            naming: body.naming.as_deref().and_then(preset),
            report: None,
            identity: Some(body.identity.clone()),
        })
    }

    /// [`PlacedModel::attach`] after [`ModelManifest::check_identity`]: a manifest made
    /// for another checkpoint (other file lengths or header bytes) is refused before
    /// anything is mapped. Reads only the checkpoint's header bytes.
    ///
    /// # Errors
    /// As [`ModelManifest::check_identity`] and [`PlacedModel::attach`].
    pub fn attach_checked(
        manifest: &ModelManifest,
        files: Vec<File>,
        checkpoint: &Checkpoint,
    ) -> Result<PlacedModel> {
        manifest.check_identity(checkpoint)?;
        PlacedModel::attach(manifest, files)
    }
}

/// `e` with the store it came from, where the error is a wrong backing.
fn with_store(e: Error, store: &str) -> Error {
    match e {
        Error::InvalidArgument { .. } if e.to_string().contains("memfd-backed") => {
            Error::wrong_backing(
                EXPORT,
                format!("{store} is not memfd-backed"),
                "a placement made with StoreOptions::shared(true)",
            )
        }
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn with_header(body: &str) -> Vec<u8> {
        format!("{MODEL_MANIFEST_HEADER}\n{body}").into_bytes()
    }

    const EMPTY: &str = r#"{"identity":{"tensors":0,"files":[]},"files":0,"tensors":[],"expert_plan":null,"dense":[],"experts":null,"naming":null}"#;

    #[test]
    fn an_empty_manifest_round_trips_and_odd_ones_are_named() {
        let m = ModelManifest::parse(&with_header(EMPTY)).unwrap();
        assert_eq!(ModelManifest::parse(&m.to_bytes()).unwrap(), m);
        assert_eq!((m.file_count(), m.tensor_count()), (0, 0));
        let cases = [
            // A number past u64 (serde_json reads it as a float), a negative count.
            (
                EMPTY.replace(r#""files":0"#, r#""files":99999999999999999999999"#),
                "expected usize",
            ),
            (EMPTY.replace(r#""tensors":0"#, r#""tensors":-3"#), "-3"),
            (
                EMPTY.replace(r#""naming":null}"#, r#""naming":null,"more":1}"#),
                "unknown field `more`",
            ),
            (
                EMPTY.replace(r#""naming":null"#, r#""naming":"made-up""#),
                "expert naming \"made-up\": not the name of a preset",
            ),
            (
                EMPTY.replace(r#""files":0,"#, r#""files":0,"files":1,"#),
                "duplicate field `files`",
            ),
            (EMPTY.replace(r#""dense":[],"#, ""), "missing field `dense`"),
            (format!("{EMPTY} trailing"), "trailing"),
            ("[".repeat(100_000), "invalid type"), // deep nesting stops at the first bracket
        ];
        for (body, needle) in cases {
            let e = ModelManifest::parse(&with_header(&body))
                .unwrap_err()
                .to_string();
            assert!(e.contains("ModelManifest::parse"), "{e}");
            assert!(e.contains(needle), "{needle}: {e}");
        }
        for (bytes, needle) in [
            (&b""[..], "not a numapin model manifest"),
            (b"numapin-model 2", "does not end with a newline"),
            (b"numapin-model 1\n{}", "unsupported version"),
            (b"numapin-model 7\n{}", "unsupported version"),
        ] {
            let e = ModelManifest::parse(bytes).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    proptest! {
        #[test]
        fn parse_never_panics(body in "[ -~\n]{0,300}") {
            let _ = ModelManifest::parse(&with_header(&body));
            let _ = ModelManifest::parse(body.as_bytes());
        }

        #[test]
        fn parse_never_panics_on_edited_manifests(at in 0usize..200, byte in any::<u8>()) {
            let mut bytes = with_header(EMPTY);
            let i = at % bytes.len();
            bytes[i] = byte;
            let _ = ModelManifest::parse(&bytes);
        }
    }
}
