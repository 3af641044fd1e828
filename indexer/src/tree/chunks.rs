//! [`Chunks`]: the arena's block slabs (slot and generation per [`BlockId`]) as a list
//! of fixed-size chunks instead of one `Vec`.
//!
//! A block slab grows by one entry per new block. As one `Vec`, each growth is a
//! `realloc` of the whole slab, and glibc serves slabs below its dynamic mmap
//! threshold (up to 32 MiB, raised by every large free) from the heap, where a
//! `realloc` copies: grown by an eighth at a time, each entry was copied about eight
//! times (8 % of a bare tree's apply in a profile at 64 workers × 2M entries), and the
//! freed old copies left holes in the heap. In chunks of [`CHUNK`] entries nothing is
//! copied, and a tree wastes at most one partly used chunk (12 KiB for both slabs).
//! The cost is one more dependent load per lookup (the chunk's pointer, from a table
//! that stays in cache); the index within a chunk needs no bounds check. Measured
//! (`docs/studies/bare-apply.md`, round two): resident bytes per entry 70 → 61 at 64
//! workers × 1M entries and 64 → 60 at 256; apply within the noise of the shared host
//! (a first version with growable chunks, bounds-checked twice per lookup, read 5–8 %
//! slower).

/// Entries per chunk (a power of two): 8 KiB of 8-byte slots, far below glibc's mmap
/// threshold, so chunks reuse freed heap memory; a tree's smallest slabs are one chunk
/// each (12 KiB).
const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;

/// A growable array of `T` in chunks of [`CHUNK`] entries; indexed like a slice.
/// Chunks are fixed-size arrays, so an index within a chunk needs no bounds check.
#[derive(Debug, Clone, Default)]
pub(super) struct Chunks<T> {
    chunks: Vec<Box<[T; CHUNK]>>,
    len: usize,
}

impl<T: Copy + Default> Chunks<T> {
    /// Entries pushed so far.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Appends `value` at index `len()`.
    pub(super) fn push(&mut self, value: T) {
        if self.len == self.chunks.len() * CHUNK {
            let chunk: Box<[T]> = vec![T::default(); CHUNK].into_boxed_slice();
            // Cannot fail: the slice has exactly `CHUNK` entries.
            let chunk: Box<[T; CHUNK]> = chunk.try_into().ok().expect("CHUNK entries");
            self.chunks.push(chunk);
        }
        let i = self.len;
        self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)] = value;
        self.len += 1;
    }

    /// Heap bytes held, by capacity (the chunk table included).
    pub(super) fn heap_bytes(&self) -> usize {
        self.chunks.capacity() * size_of::<Box<[T; CHUNK]>>()
            + self.chunks.len() * size_of::<[T; CHUNK]>()
    }
}

impl<T> std::ops::Index<usize> for Chunks<T> {
    type Output = T;

    /// Panics when `index` is past the last chunk, as a slice does past its end; an
    /// index past `len()` inside the last chunk reads a blank entry.
    fn index(&self, index: usize) -> &T {
        &self.chunks[index >> CHUNK_BITS][index & (CHUNK - 1)]
    }
}

impl<T> std::ops::IndexMut<usize> for Chunks<T> {
    fn index_mut(&mut self, index: usize) -> &mut T {
        &mut self.chunks[index >> CHUNK_BITS][index & (CHUNK - 1)]
    }
}

impl<T: Copy + Default> FromIterator<T> for Chunks<T> {
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
