//! [`Chunks`]: the arena's block slabs (slot and generation per [`BlockId`]) as a list
//! of fixed-size chunks instead of one `Vec`.
//!
//! A block slab grows by one entry per new block. As one `Vec`, each growth is a
//! `realloc` of the whole slab, and glibc serves slabs below its dynamic mmap
//! threshold (up to 32 MiB, raised by every large free) from the heap, where a
//! `realloc` copies: grown by an eighth at a time, each entry was copied about eight
//! times (8 % of a bare tree's apply in a profile at 64 workers × 2M entries), and the
//! freed old copies left holes in the heap. In chunks of [`CHUNK`] entries nothing is
//! copied once a chunk is full, and a tree wastes at most one partly used chunk (48 KiB
//! for both slabs). The first chunk grows by doubling, so a small tree stays small.
//! The cost is one more dependent load per lookup (the chunk's pointer, from a table
//! of a few hundred entries that stays in cache). Measured (`docs/studies/bare-apply.md`):
//! resident bytes per entry 70 → 64 at 64 workers × 1M entries and 64 → 59 at 256; apply
//! within the noise of the shared host.

/// Entries per chunk (a power of two): 32 KiB of 8-byte slots, below glibc's default
/// mmap threshold, so chunks reuse freed heap memory.
const CHUNK_BITS: u32 = 12;
const CHUNK: usize = 1 << CHUNK_BITS;

/// A growable array of `T` in chunks of [`CHUNK`] entries; indexed like a slice.
#[derive(Debug, Clone, Default)]
pub(super) struct Chunks<T> {
    /// Every chunk but the last is full (`CHUNK` entries).
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Chunks<T> {
    /// Entries pushed so far.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Appends `value` at index `len()`.
    pub(super) fn push(&mut self, value: T) {
        let last = match self.chunks.last_mut() {
            Some(last) if last.len() < CHUNK => last,
            _ => {
                // The first chunk starts small and doubles; later ones start full-size.
                let capacity = if self.chunks.is_empty() { 0 } else { CHUNK };
                self.chunks.push(Vec::with_capacity(capacity));
                // Just pushed, so there is a last chunk.
                self.chunks.last_mut().expect("a chunk was just pushed")
            }
        };
        if last.len() == last.capacity() {
            let grow = last.len().clamp(16, CHUNK - last.len());
            last.reserve_exact(grow);
        }
        last.push(value);
        self.len += 1;
    }

    /// Heap bytes held, by capacity (the chunk table included).
    pub(super) fn heap_bytes(&self) -> usize {
        self.chunks.capacity() * size_of::<Vec<T>>()
            + self
                .chunks
                .iter()
                .map(|c| c.capacity() * size_of::<T>())
                .sum::<usize>()
    }
}

impl<T> std::ops::Index<usize> for Chunks<T> {
    type Output = T;

    /// Panics when `index >= len()`, as a slice does.
    fn index(&self, index: usize) -> &T {
        &self.chunks[index >> CHUNK_BITS][index & (CHUNK - 1)]
    }
}

impl<T> std::ops::IndexMut<usize> for Chunks<T> {
    fn index_mut(&mut self, index: usize) -> &mut T {
        &mut self.chunks[index >> CHUNK_BITS][index & (CHUNK - 1)]
    }
}

impl<T> FromIterator<T> for Chunks<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut chunks = Chunks {
            chunks: Vec::new(),
            len: 0,
        };
        for value in iter {
            chunks.push(value);
        }
        chunks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_across_chunk_boundaries() {
        let mut c: Chunks<u32> = (0..3).collect();
        for i in 3..(2 * CHUNK as u32 + 5) {
            c.push(i);
        }
        assert_eq!(c.len(), 2 * CHUNK + 5);
        for i in [0, 1, CHUNK - 1, CHUNK, 2 * CHUNK, 2 * CHUNK + 4] {
            assert_eq!(c[i], i as u32);
        }
        c[CHUNK] = 7;
        assert_eq!(c[CHUNK], 7);
        // Three chunks, two full, and a table of at least three.
        assert!(c.heap_bytes() >= (2 * CHUNK + 5) * 4);
    }

    #[test]
    #[should_panic]
    fn index_past_the_last_chunk_panics() {
        let c: Chunks<u32> = (0..3).collect();
        let _ = c[CHUNK];
    }
}
