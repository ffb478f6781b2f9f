//! The store holds the model and nothing else: slots at a page-rounded stride, no padding
//! made resident, and transparent huge pages backing the region rather than each slot.

mod common;

use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, SlotAlign, StoreOptions};
use numapin::{Error, Region, diag};

const EXPERTS: usize = 8;
const SCALES: usize = 4096;

fn page() -> usize {
    numapin::page_size()
}

fn pack(weight_bytes: usize, slot_align: SlotAlign) -> (PinStore, numapin::store::LayerReport) {
    let options = StoreOptions::default().slot_align(slot_align);
    // The control region of the huge-page test takes this policy too.
    let layout = Layout::Interleave(numapin::NodeSet::allowed().unwrap());
    let store = PinStore::new(layout, options).unwrap();
    let weights: Vec<Vec<u8>> = (0..EXPERTS)
        .map(|e| vec![e as u8 + 1; weight_bytes])
        .collect();
    let scales = vec![9u8; SCALES];
    let sources: Vec<ExpertSource> = weights
        .iter()
        .map(|w| ExpertSource::Memory {
            weights: w,
            scales: &scales,
        })
        .collect();
    let spec = LayerSpec {
        experts: EXPERTS,
        weight_bytes,
        scale_bytes: SCALES,
    };
    let report = store.pack_layer(0, &spec, &sources).unwrap();
    (store, report)
}

/// Resident bytes of the weights region (`mincore`, exact for the range).
fn resident_weights(store: &PinStore, stride: usize) -> usize {
    let start = store.weights(0, 0).unwrap().as_ptr() as usize;
    numapin::resident_pages(start, stride * EXPERTS).unwrap() * page()
}

#[test]
fn the_default_stride_is_the_slot_rounded_to_the_page() {
    for weight_bytes in [1 << 20, (2 << 20) + 1, 2_650_000] {
        let (store, report) = pack(weight_bytes, SlotAlign::Page);
        let slot = weight_bytes.next_multiple_of(page());
        assert_eq!(report.weight_stride, slot, "{weight_bytes}");
        assert_eq!(report.scale_stride, SCALES.next_multiple_of(page()));
        // Populated and loaded, the store's resident bytes are at most the slots.
        let resident = resident_weights(&store, report.weight_stride);
        assert!(
            resident <= EXPERTS * slot,
            "{weight_bytes}: {resident} resident for {} bytes of slots",
            EXPERTS * slot
        );
        for e in 0..EXPERTS {
            assert_eq!(store.weights(0, e).unwrap().len(), weight_bytes);
        }
    }
}

/// Run alone ([`common::alone`]), and the control under the store's own policy: the
/// figures compared are huge pages the kernel managed to allocate, so the two regions
/// must ask the same nodes at nearly the same moment. Sharing the process with the other
/// tests of this binary (each packing stores of up to 21 MiB meanwhile), or the control
/// on the local node while the store interleaves over all of them (the VM's nodes hold
/// 768 MiB), let the two see different free huge pages.
#[test]
fn huge_pages_back_the_region_as_well_as_a_control_region() {
    if !common::alone("huge_pages_back_the_region_as_well_as_a_control_region") {
        return;
    }
    let policy = numapin::policy::MemPolicy::Interleave(numapin::NodeSet::allowed().unwrap());
    for weight_bytes in [(2 << 20) + 1, 2_650_000] {
        let (store, report) = pack(weight_bytes, SlotAlign::Page);
        let len = report.weight_stride * EXPERTS;
        let start = store.weights(0, 0).unwrap().as_ptr() as usize;
        let store_huge: u64 = diag::smaps_in_range(start, start + len)
            .unwrap()
            .iter()
            .map(|e| e.anon_huge)
            .sum();
        // A control region of the same length, populated the same way, in the same run.
        // Fenced: smaps must count the control alone (unbound, it would merge with the
        // store's arena where mbind is denied).
        let mut control = Region::anonymous_fenced_aligned(len, 2 << 20).unwrap();
        assert_eq!(
            control
                .bind(&policy, numapin::policy::MbindFlags::empty())
                .unwrap(),
            common::degrade_here().map_or(
                numapin::policy::Placement::Bound,
                numapin::policy::Placement::Degraded
            )
        );
        control.advise(numapin::Advice::HugePage).unwrap();
        control.populate_write().unwrap();
        let control_huge = control.memory().unwrap().anon_huge;
        assert!(
            store_huge * 10 >= control_huge * 9,
            "{weight_bytes}: store {store_huge} THP bytes, control {control_huge}"
        );
    }
}

#[test]
fn huge_page_aligned_slots_pay_padding_and_other_alignments_are_checked() {
    let (store, report) = pack((2 << 20) + 1, SlotAlign::HugePage);
    assert_eq!(report.weight_stride, 4 << 20);
    assert_eq!(store.weights(0, 7).unwrap().len(), (2 << 20) + 1);
    let (_, report) = pack(10_000, SlotAlign::Bytes(64 << 10));
    assert_eq!(report.weight_stride, 64 << 10);
    for bad in [0, 3, 100, page() / 2] {
        let options = StoreOptions::default().slot_align(SlotAlign::Bytes(bad));
        match PinStore::new(Layout::Unplaced, options) {
            Err(Error::InvalidArgument { .. }) => {}
            other => panic!("{bad}: {other:?}"),
        }
    }
}
