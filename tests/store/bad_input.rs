//! Bad input to a store: sources that do not fit the spec, specs that overflow or hold
//! no experts, requests a packed layer refuses; each a typed error, and the store stays
//! usable.

use super::*;

/// Asserts an `InvalidArgument` whose reason says `needle`.
fn invalid(r: numapin::Result<numapin::store::LayerReport>, needle: &str) {
    match r {
        Err(Error::InvalidArgument { reason, .. }) => {
            let reason = reason.to_string();
            assert!(reason.contains(needle), "{reason} lacks {needle:?}")
        }
        other => panic!("expected an error with {needle:?}, got {other:?}"),
    }
}

#[test]
fn bad_input_is_an_error_and_the_store_stays_usable() {
    let dir = temp_dir("bad-input");
    let path = write_model_file(&dir, 0, 2, 4096, 0);
    let file = std::fs::File::open(&path).unwrap();
    let mut store = PinStore::new(interleave(), StoreOptions::default()).unwrap();
    let spec = LayerSpec {
        experts: 2,
        weight_bytes: 4096,
        scale_bytes: 64,
    };
    let data = layer_data(0, 2, 4096, 64);
    let good = memory_sources(&data);
    let big = vec![0u8; 4097];

    pack_refuses_sources_that_do_not_fit(&store, &spec, &data, &file, &big);
    pack_refuses_bad_specs(&store, &spec, &data);
    assert_eq!(store.stats().unwrap().layers, 0);
    // Still usable: pack, then the errors that need a packed layer.
    store.pack_layer(0, &spec, &good).unwrap();
    a_packed_layer_refuses_bad_requests(&mut store, &spec, &data, &big);
    assert!(PinStore::new(Layout::Interleave(NodeSet::new()), StoreOptions::default()).is_err());
    assert!(PinStore::new(interleave(), StoreOptions::default().loader_threads(0)).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Packing layer 0 with sources that do not fit the spec (too few, too large, past the
/// end of their file): each a typed error naming what is wrong; nothing is packed.
fn pack_refuses_sources_that_do_not_fit(
    store: &PinStore,
    spec: &LayerSpec,
    data: &[(Vec<u8>, Vec<u8>)],
    file: &std::fs::File,
    big: &[u8],
) {
    let spec = *spec;
    let good = memory_sources(data);
    assert!(matches!(
        store.pack_layer(0, &spec, &good[..1]),
        Err(Error::InvalidArgument {
            reason: Invalid::Mismatch {
                expected: 2,
                found: 1,
                ..
            },
            ..
        })
    ));
    invalid(
        store.pack_layer(0, &spec, &good[..1]),
        "one per expert of the spec: 2 expected but 1 given",
    );
    let too_big = vec![
        good[0].clone(),
        ExpertSource::Memory {
            weights: big,
            scales: &[],
        },
    ];
    match store.pack_layer(0, &spec, &too_big) {
        Err(Error::InvalidArgument {
            reason:
                Invalid::TooLarge {
                    size: 4097,
                    max: 4096,
                    ..
                },
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    invalid(
        store.pack_layer(0, &spec, &too_big),
        "4097 bytes but the slot holds 4096",
    );
    let short = vec![
        good[0].clone(),
        ExpertSource::from_file(file, &[(4096, 100), (8190, 10)], &[]),
    ];
    match store.pack_layer(0, &spec, &short) {
        Err(Error::InvalidArgument {
            reason:
                Invalid::OutOfBounds {
                    start: 8190,
                    end: 8200,
                    within: "the file",
                    ..
                },
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    invalid(
        store.pack_layer(0, &spec, &short),
        "piece at file offsets 8190..8200 runs past the end of the file (8192 bytes)",
    );
}

/// Specs whose sizes overflow or that hold no experts, a layer index past the table:
/// each an error; nothing is packed.
fn pack_refuses_bad_specs(store: &PinStore, spec: &LayerSpec, data: &[(Vec<u8>, Vec<u8>)]) {
    let spec = *spec;
    let good = memory_sources(data);
    let overflow = LayerSpec {
        experts: usize::MAX / 4096,
        weight_bytes: 4096 * 4,
        scale_bytes: 0,
    };
    assert!(store.pack_layer(0, &overflow, &[]).is_err());
    let huge_slot = LayerSpec {
        experts: 2,
        weight_bytes: usize::MAX - 10,
        scale_bytes: 0,
    };
    let weights_only: Vec<ExpertSource> = data
        .iter()
        .map(|(w, _)| ExpertSource::Memory {
            weights: w,
            scales: &[],
        })
        .collect();
    assert!(matches!(
        store.pack_layer(0, &huge_slot, &weights_only),
        Err(Error::InvalidArgument {
            reason: Invalid::Overflow { .. },
            ..
        })
    ));
    invalid(store.pack_layer(0, &huge_slot, &weights_only), "overflow");
    invalid(
        store.pack_layer(0, &LayerSpec { experts: 0, ..spec }, &[]),
        "no experts",
    );
    // A layer index past the store's table is an index out of range, like an expert's.
    assert!(matches!(
        store.pack_layer(usize::MAX, &spec, &good),
        Err(Error::OutOfRange {
            index: usize::MAX,
            ..
        })
    ));
}

/// With layer 0 packed: packing it again, indices past it, a released slot, an ensure
/// that does not fit (the slot stays released), then one that does.
fn a_packed_layer_refuses_bad_requests(
    store: &mut PinStore,
    spec: &LayerSpec,
    data: &[(Vec<u8>, Vec<u8>)],
    big: &[u8],
) {
    let good = memory_sources(data);
    assert!(matches!(
        store.pack_layer(0, spec, &good),
        Err(Error::AlreadyPacked {
            layer: 0,
            in_progress: false,
            ..
        })
    ));
    assert!(matches!(
        store.weights(0, 2),
        Err(Error::OutOfRange {
            index: 2,
            len: 2,
            ..
        })
    ));
    assert!(matches!(
        store.weights(1, 0),
        Err(Error::NotPacked { layer: 1, .. })
    ));
    assert!(matches!(
        store.release(0, 2),
        Err(Error::OutOfRange {
            index: 2,
            len: 2,
            ..
        })
    ));
    assert!(matches!(
        store.ensure(0, 9, &good[0]),
        Err(Error::OutOfRange {
            index: 9,
            len: 2,
            ..
        })
    ));
    store.release(0, 1).unwrap();
    assert!(matches!(
        store.weights(0, 1),
        Err(Error::Released {
            layer: 0,
            expert: 1,
            kind: "weights",
            ..
        })
    ));
    let bad_ensure = ExpertSource::Memory {
        weights: big,
        scales: &[],
    };
    assert!(store.ensure(0, 1, &bad_ensure).is_err());
    assert!(
        matches!(store.weights(0, 1), Err(Error::Released { .. })),
        "a failed ensure leaves the slot released"
    );
    store.ensure(0, 1, &good[1]).unwrap();
    assert_eq!(store.weights(0, 1).unwrap(), &data[1].0[..]);
}
