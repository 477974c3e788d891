//! Write heat: which blocks are being rewritten, the evidence the destager uses to keep data
//! on the fast tier (where rewrites are cheap) instead of moving it to the capacity tier.
//!
//! Every block a host writes is *seen*; a block written again while it is still seen (on
//! either tier) gains heat, and so does a tier-mode block that is read. Heat fades with time
//! measured in host writes: it halves each epoch (one log's worth of written blocks), lazily,
//! when the entry is next looked at. The destager halves it again each time it keeps or moves
//! the block, so data that stops being rewritten soon goes cold. The table holds at most as
//! many entries as the log has blocks; when it is full, entries that have faded out are
//! dropped (at most one sweep per epoch) and new blocks are not tracked until there is room.

use std::collections::HashMap;

/// One block's heat and the epoch it was last updated in.
#[derive(Debug, Clone, Copy)]
struct Entry {
    heat: u8,
    epoch: u32,
}

#[derive(Debug)]
pub struct Heat {
    map: HashMap<(u32, u64), Entry>,
    cap: usize,
    epoch: u32,
    /// Blocks written in the current epoch.
    written: u64,
    /// Blocks written per epoch.
    epoch_blocks: u64,
    /// The last epoch a full table was swept in.
    swept: Option<u32>,
}

impl Heat {
    /// A table for a log of `log_blocks` blocks.
    pub fn new(log_blocks: u64) -> Heat {
        Heat {
            map: HashMap::new(),
            cap: log_blocks.max(1) as usize,
            epoch: 0,
            written: 0,
            epoch_blocks: log_blocks.max(1),
            swept: None,
        }
    }

    fn faded(&self, e: Entry) -> u8 {
        let age = self.epoch.wrapping_sub(e.epoch);
        if age >= 8 {
            0
        } else {
            e.heat >> age
        }
    }

    /// Heat of a block now (0 when not tracked).
    pub fn get(&self, layer: u32, lba: u64) -> u8 {
        self.map.get(&(layer, lba)).map_or(0, |&e| self.faded(e))
    }

    /// Whether any block is tracked.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Entries tracked.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// A host wrote these blocks: a block already seen gains heat, a new one is seen.
    pub fn note_write(&mut self, layer: u32, lba: u64, n: u64) {
        for b in lba..lba + n {
            self.bump(layer, b, 0);
        }
        self.written += n;
        if self.written >= self.epoch_blocks {
            self.written = 0;
            self.epoch = self.epoch.wrapping_add(1);
        }
    }

    /// These blocks were read (tier mode): evidence of heat whether seen before or not.
    pub fn note_read(&mut self, layer: u32, lba: u64, n: u64) {
        for b in lba..lba + n {
            self.bump(layer, b, 1);
        }
    }

    /// Adds one to a tracked block's heat, or starts tracking it at `first`.
    fn bump(&mut self, layer: u32, lba: u64, first: u8) {
        let epoch = self.epoch;
        if let Some(e) = self.map.get(&(layer, lba)).copied() {
            let heat = self.faded(e).saturating_add(1);
            self.map.insert((layer, lba), Entry { heat, epoch });
            return;
        }
        if self.map.len() >= self.cap && !self.sweep() {
            return;
        }
        self.map.insert((layer, lba), Entry { heat: first, epoch });
    }

    /// Drops the entries that have faded out and were not touched this epoch. Returns
    /// whether there is room now. Sweeps at most once per epoch.
    fn sweep(&mut self) -> bool {
        if self.swept != Some(self.epoch) {
            self.swept = Some(self.epoch);
            let epoch = self.epoch;
            self.map.retain(|_, e| {
                let age = epoch.wrapping_sub(e.epoch);
                age == 0 || (age < 8 && e.heat >> age > 0)
            });
        }
        self.map.len() < self.cap
    }

    /// The block moved or was kept by the destager: its heat halves (it stays seen).
    pub fn halve(&mut self, layer: u32, lba: u64) {
        let epoch = self.epoch;
        if let Some(e) = self.map.get(&(layer, lba)).copied() {
            let heat = self.faded(e) / 2;
            self.map.insert((layer, lba), Entry { heat, epoch });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_write_is_heat_and_heat_fades_with_writes_elsewhere() {
        let mut h = Heat::new(100);
        h.note_write(1, 7, 1);
        assert_eq!(h.get(1, 7), 0, "a first write is no evidence");
        h.note_write(1, 7, 1);
        h.note_write(1, 7, 1);
        assert_eq!(h.get(1, 7), 2);
        assert_eq!(h.get(2, 7), 0, "layers are apart");
        // One epoch of writes elsewhere halves it, another clears it.
        h.note_write(1, 1000, 100);
        assert_eq!(h.get(1, 7), 1);
        h.note_write(1, 2000, 100);
        assert_eq!(h.get(1, 7), 0);
    }

    #[test]
    fn heat_survives_a_move_halved_and_reads_count_from_the_first() {
        let mut h = Heat::new(1000);
        for _ in 0..5 {
            h.note_write(3, 9, 2);
        }
        assert_eq!(h.get(3, 10), 4);
        h.halve(3, 10);
        assert_eq!(h.get(3, 10), 2);
        // Seen still: the next write after the move is a rewrite.
        h.halve(3, 10);
        h.halve(3, 10);
        assert_eq!(h.get(3, 10), 0);
        h.note_write(3, 10, 1);
        assert_eq!(h.get(3, 10), 1);
        h.note_read(3, 500, 1);
        assert_eq!(h.get(3, 500), 1);
    }

    #[test]
    fn the_table_is_bounded_and_a_full_one_drops_faded_entries() {
        let mut h = Heat::new(10);
        for b in 0..10 {
            h.note_write(1, b, 1);
        }
        // Epoch turned at the tenth block; the table is full of first writes.
        assert_eq!(h.len(), 10);
        h.note_write(1, 0, 1);
        assert_eq!(h.get(1, 0), 1, "a tracked block still gains heat when full");
        h.note_write(1, 50, 1);
        assert!(h.len() <= 10);
        assert_eq!(
            h.len(),
            2,
            "faded first writes of the last epoch are dropped"
        );
        for b in 100..120 {
            h.note_write(1, b, 1);
        }
        assert!(h.len() <= 10, "never more entries than log blocks");
        assert_eq!(h.get(1, 0), 0);
    }
}
