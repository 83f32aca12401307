//! The checksum of stored KV blocks (a worker's tiers, the cluster's store), computed as the bytes are copied (a load reads the page from
//! memory once, as a plain copy does, the sums kept in registers beside the copy): eight
//! lanes of Fletcher-style sums over 64-bit words — each lane's running sum and the sum of its
//! running sums, so a changed, missing or moved word changes it — mixed with the length at the
//! end. A page is several segments (a layer's keys, its values, …); the sum runs over them as
//! one stream. It catches storage corruption (a flipped bit, a torn or truncated file); it is
//! not a defence against someone who can write the tier's files (only the worker's own user
//! can).
//!
//! Beside it, FNV-1a ([`fnv1a`]): a small hash of names and ids, the same in every process.

const LANES: usize = 8;
const CHUNK: usize = LANES * 8;

/// A checksum over bytes fed in order.
pub struct Summer {
    a: [u64; LANES],
    b: [u64; LANES],
    tail: [u8; CHUNK],
    tail_len: usize,
    len: u64,
}

impl Default for Summer {
    fn default() -> Self {
        Summer {
            a: [0; LANES],
            b: [0; LANES],
            tail: [0; CHUNK],
            tail_len: 0,
            len: 0,
        }
    }
}

impl Summer {
    fn chunk(&mut self, c: &[u8]) {
        self.chunks(None, c)
    }

    /// Sums whole chunks of `src`, copying each into `dst` (the same length) on its way when
    /// there is one: one pass over memory, the sums in registers beside the copy.
    fn chunks(&mut self, dst: Option<&mut [u8]>, src: &[u8]) {
        debug_assert_eq!(src.len() % CHUNK, 0);
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: this CPU has AVX2 (checked just above).
            return unsafe { self.chunks_avx2(dst, src) };
        }
        self.chunks_any(dst, src)
    }

    /// [`Summer::chunks`] compiled for AVX2 (the same code, in vectors twice as wide).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn chunks_avx2(&mut self, dst: Option<&mut [u8]>, src: &[u8]) {
        self.chunks_any(dst, src)
    }

    #[inline(always)]
    fn chunks_any(&mut self, dst: Option<&mut [u8]>, src: &[u8]) {
        let (mut a, mut b) = (self.a, self.b);
        match dst {
            Some(d) => {
                for (o, c) in d.chunks_exact_mut(CHUNK).zip(src.chunks_exact(CHUNK)) {
                    o.copy_from_slice(c);
                    accumulate(&mut a, &mut b, c);
                }
            }
            None => {
                for c in src.chunks_exact(CHUNK) {
                    accumulate(&mut a, &mut b, c);
                }
            }
        }
        (self.a, self.b) = (a, b);
    }

    /// Sums `src`; with `dst`, copies it there too (same length), in the same pass.
    fn feed(&mut self, mut dst: Option<&mut [u8]>, mut src: &[u8]) {
        self.len += src.len() as u64;
        if self.tail_len > 0 {
            let take = (CHUNK - self.tail_len).min(src.len());
            self.tail[self.tail_len..self.tail_len + take].copy_from_slice(&src[..take]);
            if let Some(d) = dst.take() {
                let (head, rest) = d.split_at_mut(take);
                head.copy_from_slice(&src[..take]);
                dst = Some(rest);
            }
            self.tail_len += take;
            src = &src[take..];
            if self.tail_len < CHUNK {
                return;
            }
            let t = self.tail;
            self.chunk(&t);
            self.tail_len = 0;
        }
        let whole = src.len() / CHUNK * CHUNK;
        let (body, rest) = src.split_at(whole);
        match dst {
            Some(d) => {
                let (d_body, d_rest) = d.split_at_mut(whole);
                self.chunks(Some(d_body), body);
                d_rest.copy_from_slice(rest);
            }
            None => self.chunks(None, body),
        }
        self.tail[..rest.len()].copy_from_slice(rest);
        self.tail_len = rest.len();
    }

    /// Sums `src`.
    pub fn sum(&mut self, src: &[u8]) {
        self.feed(None, src)
    }

    /// Copies `src` into `dst` (of the same length), summing it.
    pub fn copy(&mut self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(
            dst.len(),
            src.len(),
            "a checksummed copy needs equal lengths"
        );
        self.feed(Some(dst), src)
    }

    /// The checksum of everything fed.
    pub fn finish(mut self) -> u64 {
        if self.tail_len > 0 {
            let mut t = [0u8; CHUNK];
            t[..self.tail_len].copy_from_slice(&self.tail[..self.tail_len]);
            self.chunk(&t);
        }
        let mut h = self.len.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        for i in 0..LANES {
            h = (h ^ self.a[i])
                .rotate_left(23)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            h = (h ^ self.b[i])
                .rotate_left(31)
                .wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        }
        h ^ (h >> 29)
    }
}

/// One chunk's words into the lanes' running sums `a` and their sums `b`.
#[inline(always)]
fn accumulate(a: &mut [u64; LANES], b: &mut [u64; LANES], c: &[u8]) {
    for i in 0..LANES {
        let w = u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        a[i] = a[i].wrapping_add(w);
        b[i] = b[i].wrapping_add(a[i]);
    }
}

/// Copies `src` into `dst` (of the same length) and returns the checksum of the bytes.
pub fn copy_sum(dst: &mut [u8], src: &[u8]) -> u64 {
    let mut s = Summer::default();
    s.copy(dst, src);
    s.finish()
}

/// The checksum of `src` (no copy).
pub fn sum(src: &[u8]) -> u64 {
    let mut s = Summer::default();
    s.sum(src);
    s.finish()
}

/// A stored block's checksum: its bytes' (`data_sum`) with its tokens.
pub fn block_sum(tokens: &[u32], data_sum: u64) -> u64 {
    let mut s = Summer::default();
    for t in tokens {
        s.sum(&t.to_le_bytes());
    }
    s.finish() ^ data_sum.rotate_left(17).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_copies_and_changes_with_any_bit_moved_word_or_length() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let s = copy_sum(&mut dst, &src);
        assert_eq!(dst, src);
        assert_eq!(s, sum(&src), "the copying and the plain sum agree");
        let mut pieces = Summer::default();
        for part in [&src[..5], &src[5..40], &src[40..41], &src[41..]] {
            pieces.sum(part);
        }
        assert_eq!(pieces.finish(), s, "segments sum as one stream");
        for bit in [0, 9, 8 * 31, 8 * 999 + 7] {
            let mut bad = src.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(sum(&bad), s, "bit {bit} flipped");
        }
        let mut swapped = src.clone();
        swapped.swap(0, 32);
        swapped.swap(1, 33);
        assert_ne!(sum(&swapped), s, "two words of one lane swapped");
        assert_ne!(sum(&src[..999]), s, "truncated");
        assert_ne!(sum(&[0u8; 40]), sum(&[0u8; 41]), "zeros of two lengths");
        assert_ne!(block_sum(&[1, 2], s), block_sum(&[2, 1], s), "tokens count");
    }
}

/// FNV-1a's offset basis, where a digest starts.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// One value into an FNV-1a digest (a byte, or a token id or a length taken whole): a small
/// hash that is the same in every process and build (placement, n-grams, answers' digests).
pub fn fnv1a(h: u64, v: u64) -> u64 {
    (h ^ v).wrapping_mul(0x0100_0000_01b3)
}
