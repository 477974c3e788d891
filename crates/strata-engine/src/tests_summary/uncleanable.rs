//! A segment whose summary header is damaged in both copies cannot be cleaned (GC needs the
//! entries to know what its blocks are), but its blocks still read (their crcs are in the crc
//! blocks): GC must clean the others around it, and not read it again at every look.

use super::*;

/// Half-dead segments, one of them with its header damaged in both copies; a second volume
/// fills the tier until GC must clean. Before, GC's plan stopped at the first summary it could
/// not read, so with that segment among the candidates (the emptiest first when space runs
/// short) GC cleaned nothing, ever, and read the summary again at every look.
#[test]
fn gc_cleans_around_a_segment_whose_summary_header_is_lost() {
    let mut rig = Rig::new(16 * MIB, &[24 * MIB], small_cfg(), 66);
    let (dg, v, victims) = half_dead(&mut rig);
    let fill = half_dead_fill;
    assert!(victims.len() >= 2, "{victims:?}");
    let lost = victims[0];
    for copy in 0..dg.sh.layout.geo.summary_copies {
        flip(&rig, &dg, lost, copy, header(&dg));
    }
    dg.sh.summaries.lock().forget(|_| true);
    let w = dg.create_volume("w", 16 * MIB).unwrap().id;
    let mut lba = 0;
    while dg.stats().gc_segments_cleaned_total == 0 && lba < 4096 {
        for _ in 0..125 {
            dg.write(w, lba * BLOCK_U64, &block_of(lba, 0x42))
                .unwrap_or_else(|e| panic!("block {lba} of w: {e}: {:?}", dg.stats()));
            lba += 1;
        }
        assert!(
            dg.destage_all(Duration::from_secs(20)),
            "at block {lba} of w: {:?}",
            dg.stats()
        );
    }
    let st = dg.stats();
    assert!(st.gc_segments_cleaned_total > 0, "GC never cleaned: {st:?}");
    // GC goes on looking while free segments are short: the segment is not read again.
    std::thread::sleep(Duration::from_millis(500));
    let st = dg.stats();
    assert_eq!(
        st.checksum_errors_total, 1,
        "the lost header counted (read) once: {st:?}"
    );
    assert_eq!(
        dg.sh.segs.lock().segs[lost as usize].state,
        SegState::Sealed,
        "the segment GC cannot clean stays as it is"
    );
    assert_eq!(st.gc_segments_passed_over, 1, "{st:?}");
    assert!(check_v(&dg, v, fill).is_empty());
    drop(dg);
    rig.power_cut_and_restart();
    assert!(check_v(rig.dg(), v, fill).is_empty());
}
