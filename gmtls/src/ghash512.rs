//! GHASH (NIST SP 800-38D §6.4) on VPCLMULQDQ: four blocks a register, up to 64 blocks a
//! window with one reduction.
//!
//! Computed as POLYVAL (RFC 8452), as the `ghash` crate does: GHASH_H(X₁ … Xₙ) =
//! ByteReverse(POLYVAL_H′(ByteReverse(X₁) … ByteReverse(Xₙ))) with H′ =
//! mulX_POLYVAL(ByteReverse(H)) (RFC 8452 Appendix A). In POLYVAL's order a block is a
//! little-endian integer, so the byte reversal is one shuffle a register and the carry-less
//! products need no bit reflection.
//!
//! POLYVAL's product is dot(a, b) = a·b·x⁻¹²⁸ mod P, P = x¹²⁸ + x¹²⁷ + x¹²⁶ + x¹²¹ + 1. The
//! 255-bit carry-less product c = c_hi·x¹²⁸ + c_lo is reduced 64 bits at a time
//! (Montgomery): adding c₀·P, c₀ being c's low 64 bits, clears them, and dividing by x⁶⁴
//! leaves swap(c_lo) ⊕ c₀·(x⁶³ + x⁶² + x⁵⁷) below c_hi·x⁶⁴; twice, then c_hi added.
//!
//! A window of k ≤ 64 blocks from state S is dot(S ⊕ X₁, H′ᵏ) ⊕ dot(X₂, H′ᵏ⁻¹) ⊕ … ⊕
//! dot(Xₖ, H′), the powers taken with dot: the products are summed unreduced and reduced
//! once. The tests check the whole GCM against RustCrypto's generic GCM over the `sm4`
//! crate, and this hash against the `ghash` crate.

use std::arch::x86_64::*;

/// x⁶³ + x⁶² + x⁵⁷: P's low terms above x⁰, divided by x⁶⁴.
const P1: i64 = 0xC200_0000_0000_0000_u64 as i64;
/// Blocks reduced together: a TLS record of up to ~1 KiB, its associated data and lengths
/// block with it, is one window and one reduction.
const WINDOW: usize = 64;

/// The hash key's powers.
#[derive(Clone)]
pub struct Powers {
    /// H′⁶⁴, H′⁶³, …, H′¹, then four zeros: block i of a window of k blocks takes the power
    /// at 64 − k + i, so a register's four keys are four entries in a row (those past the
    /// window's end zero).
    h: Box<[u128; WINDOW + 4]>,
}

pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("vpclmulqdq")
        && std::arch::is_x86_feature_detected!("pclmulqdq")
}

impl Powers {
    /// The powers of H′ for GHASH's key `h`; `None` where the CPU lacks the instructions.
    pub fn new(h: &[u8; 16]) -> Option<Self> {
        if !available() {
            return None;
        }
        // mulX_POLYVAL: a shift left by one, P's low terms added if x¹²⁸ fell out.
        let reversed = u128::from_be_bytes(*h);
        let carry = 0u128.wrapping_sub(reversed >> 127);
        let h1 = (reversed << 1) ^ (carry & 0xC200_0000_0000_0000_0000_0000_0000_0001);
        let mut powers = Powers {
            h: Box::new([0; WINDOW + 4]),
        };
        let mut power = h1;
        for k in 1..=WINDOW {
            powers.h[WINDOW - k] = power;
            // SAFETY: `available` held above.
            power = unsafe { dot128(power, h1) };
        }
        Some(powers)
    }

    /// GHASH_H(A, C): the associated data and the ciphertext each zero-padded to whole
    /// blocks, then their lengths in bits, 64 bits each, big-endian.
    pub fn ghash(&self, aad: &[u8], ciphertext: &[u8]) -> [u8; 16] {
        // SAFETY: a `Powers` exists only where `available` held.
        unsafe { self.ghash_wide(aad, ciphertext) }
    }

    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    fn ghash_wide(&self, aad: &[u8], ciphertext: &[u8]) -> [u8; 16] {
        // All in one window where it fits: associated data, ciphertext and lengths block.
        if let Some(mut window) = self.window(aad, ciphertext.len()) {
            window.sum.add(ciphertext, window.keys, _mm_setzero_si128());
            return window.finish();
        }
        let lengths = _mm_set_epi64x(
            (aad.len() as u64 * 8) as i64,
            (ciphertext.len() as u64 * 8) as i64,
        );
        let y = self.absorb(_mm_setzero_si128(), aad);
        let y = self.absorb(y, ciphertext);
        let h1 = load128(self.h[WINDOW - 1]);
        to_bytes(Products::default().reduce_with(_mm_xor_si128(y, lengths), h1))
    }

    /// The state after `data`, zero-padded to whole blocks, from state `y`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    fn absorb(&self, mut y: __m128i, data: &[u8]) -> __m128i {
        for window in data.chunks(16 * WINDOW) {
            let blocks = window.len().div_ceil(16);
            let mut sum = Products::default();
            sum.add(window, &self.h[WINDOW - blocks..], y);
            y = sum.reduce();
        }
        y
    }
}

/// GHASH of a message whose associated data, ciphertext and lengths block fit one window,
/// the ciphertext handed over 64 bytes at a time as the counter mode makes or reads it.
pub struct Window<'a> {
    sum: Products,
    /// The ciphertext's keys, from its first block's on.
    keys: &'a [u128],
    lengths: __m128i,
    h1: __m128i,
}

impl Powers {
    /// The window of a message with `aad` and `ciphertext_len` bytes of ciphertext, the
    /// associated data added; `None` if they do not fit one window.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    pub fn window(&self, aad: &[u8], ciphertext_len: usize) -> Option<Window<'_>> {
        let (a, c) = (aad.len().div_ceil(16), ciphertext_len.div_ceil(16));
        if a + c >= WINDOW {
            return None;
        }
        let first = WINDOW - (a + c + 1);
        let mut sum = Products::default();
        sum.add(aad, &self.h[first..], _mm_setzero_si128());
        Some(Window {
            sum,
            keys: &self.h[first + a..],
            lengths: _mm_set_epi64x(
                (aad.len() as u64 * 8) as i64,
                (ciphertext_len as u64 * 8) as i64,
            ),
            h1: load128(self.h[WINDOW - 1]),
        })
    }
}

impl Window<'_> {
    /// Adds ciphertext bytes `64 · register` to `64 · register + 63` (zero past its end).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    pub fn add(&mut self, register: usize, text: __m512i) {
        let four = &self.keys[4 * register..4 * register + 4];
        // SAFETY: four `u128` in a row.
        let h = unsafe { _mm512_loadu_si512(four.as_ptr().cast()) };
        self.sum
            .add_register(_mm512_shuffle_epi8(text, reverse()), h);
    }

    /// GHASH_H(A, C).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    pub fn finish(self) -> [u8; 16] {
        to_bytes(self.sum.reduce_with(self.lengths, self.h1))
    }
}

/// The byte order of a block reversed, in each 128-bit lane: GHASH's order to POLYVAL's.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn reverse() -> __m512i {
    _mm512_broadcast_i32x4(_mm_setr_epi8(
        15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
    ))
}

/// POLYVAL's state as GHASH's bytes.
#[inline]
#[target_feature(enable = "sse2")]
fn to_bytes(y: __m128i) -> [u8; 16] {
    let mut out = [0u8; 16];
    // SAFETY: an unaligned 16-byte store into a 16-byte array.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), y) };
    u128::from_le_bytes(out).to_be_bytes()
}

/// Carry-less products of blocks with their powers, summed unreduced: the low, middle and
/// high 64-bit-aligned parts, four lanes each.
struct Products {
    lo: __m512i,
    mid: __m512i,
    hi: __m512i,
}

impl Default for Products {
    fn default() -> Self {
        // SAFETY: AVX-512F: a `Products` is made only inside the functions above, which
        // run only where `available` held.
        let zero = unsafe { _mm512_setzero_si512() };
        Products {
            lo: zero,
            mid: zero,
            hi: zero,
        }
    }
}

impl Products {
    /// Adds `data`'s blocks (the last zero-padded), block i times `keys[i]`, `y` XORed into
    /// the first block. `keys` holds at least `data`'s blocks rounded up to four.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    fn add(&mut self, data: &[u8], keys: &[u128], y: __m128i) {
        let registers = data.len().div_ceil(64);
        for (j, four) in keys.chunks_exact(4).take(registers).enumerate() {
            let at = 64 * j;
            let n = (data.len() - at).min(64);
            let bytes = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
            // SAFETY: `at` is inside `data`; the masked load reads only its `n` bytes from
            // there. The keys: four `u128` in a row.
            let (text, h) = unsafe {
                (
                    _mm512_maskz_loadu_epi8(bytes, data.as_ptr().add(at).cast()),
                    _mm512_loadu_si512(four.as_ptr().cast()),
                )
            };
            let mut x = _mm512_shuffle_epi8(text, reverse());
            if j == 0 {
                x = _mm512_xor_si512(x, _mm512_zextsi128_si512(y));
            }
            self.add_register(x, h);
        }
    }

    /// Adds four blocks (POLYVAL's order) times their four keys.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    fn add_register(&mut self, x: __m512i, h: __m512i) {
        self.lo = _mm512_xor_si512(self.lo, _mm512_clmulepi64_epi128::<0x00>(x, h));
        self.hi = _mm512_xor_si512(self.hi, _mm512_clmulepi64_epi128::<0x11>(x, h));
        self.mid = _mm512_ternarylogic_epi64::<0x96>(
            self.mid,
            _mm512_clmulepi64_epi128::<0x01>(x, h),
            _mm512_clmulepi64_epi128::<0x10>(x, h),
        );
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    fn reduce(self) -> __m128i {
        reduce(fold(self.lo), fold(self.mid), fold(self.hi))
    }

    /// The sum with one more block `x` times `h`, reduced.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    fn reduce_with(self, x: __m128i, h: __m128i) -> __m128i {
        let lo = _mm_xor_si128(fold(self.lo), _mm_clmulepi64_si128::<0x00>(x, h));
        let hi = _mm_xor_si128(fold(self.hi), _mm_clmulepi64_si128::<0x11>(x, h));
        let mid = _mm_xor_si128(
            fold(self.mid),
            _mm_xor_si128(
                _mm_clmulepi64_si128::<0x01>(x, h),
                _mm_clmulepi64_si128::<0x10>(x, h),
            ),
        );
        reduce(lo, mid, hi)
    }
}

impl Drop for Powers {
    /// The powers are the hash key: wiped when the cipher goes.
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.h[..]);
    }
}

/// The four 128-bit lanes XORed into one.
#[inline]
#[target_feature(enable = "avx512f")]
fn fold(z: __m512i) -> __m128i {
    let half = _mm256_xor_si256(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64::<1>(z));
    _mm_xor_si128(
        _mm256_castsi256_si128(half),
        _mm256_extracti128_si256::<1>(half),
    )
}

/// c·x⁻¹²⁸ mod P for c = hi·x¹²⁸ ⊕ mid·x⁶⁴ ⊕ lo (see the module's note).
#[inline]
#[target_feature(enable = "sse2,pclmulqdq")]
fn reduce(lo: __m128i, mid: __m128i, hi: __m128i) -> __m128i {
    let c_lo = _mm_xor_si128(lo, _mm_slli_si128::<8>(mid));
    let c_hi = _mm_xor_si128(hi, _mm_srli_si128::<8>(mid));
    let p1 = _mm_set_epi64x(0, P1);
    let step = |c: __m128i| {
        _mm_xor_si128(
            _mm_shuffle_epi32::<0x4e>(c),
            _mm_clmulepi64_si128::<0x00>(c, p1),
        )
    };
    _mm_xor_si128(c_hi, step(step(c_lo)))
}

#[inline]
#[target_feature(enable = "sse2")]
fn load128(x: u128) -> __m128i {
    let bytes = x.to_le_bytes();
    // SAFETY: an unaligned 16-byte load from a 16-byte array.
    unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) }
}

#[target_feature(enable = "sse2,pclmulqdq")]
fn dot128(a: u128, b: u128) -> u128 {
    let (a, b) = (load128(a), load128(b));
    let lo = _mm_clmulepi64_si128::<0x00>(a, b);
    let hi = _mm_clmulepi64_si128::<0x11>(a, b);
    let mid = _mm_xor_si128(
        _mm_clmulepi64_si128::<0x01>(a, b),
        _mm_clmulepi64_si128::<0x10>(a, b),
    );
    let mut out = [0u8; 16];
    // SAFETY: an unaligned 16-byte store into a 16-byte array.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), reduce(lo, mid, hi)) };
    u128::from_le_bytes(out)
}

#[cfg(test)]
mod tests {
    use ghash::GHash;
    use ghash::universal_hash::UniversalHash;

    use super::*;

    /// Against the `ghash` crate on random keys, associated data and messages across the
    /// window and register boundaries.
    #[test]
    fn agrees_with_the_ghash_crate() {
        if !available() {
            eprintln!("skipped: no VPCLMULQDQ on this CPU");
            return;
        }
        let mut state = 0x9E37_79B9_7F4A_7C15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        };
        // Across the register (4 blocks) and window (64 blocks) boundaries, with the
        // associated data in the ciphertext's window or not.
        let lengths = (0..=80).chain([
            255, 256, 257, 511, 512, 513, 600, 622, 991, 992, 993, 1007, 1008, 1009, 1023, 1024,
            1025, 2047, 2048, 2049, 4096, 4113,
        ]);
        for (len, aad_len) in lengths.flat_map(|len| {
            [0, 1, 5, 16, 17, 31, 32, 33, 300, 1024, 1025]
                .into_iter()
                .map(move |a| (len, a))
        }) {
            let h: [u8; 16] = std::array::from_fn(|_| next());
            let aad: Vec<u8> = (0..aad_len).map(|_| next()).collect();
            let text: Vec<u8> = (0..len).map(|_| next()).collect();
            let ours = Powers::new(&h).expect("available").ghash(&aad, &text);

            let mut theirs = GHash::new(&h.into());
            theirs.update_padded(&aad);
            theirs.update_padded(&text);
            let mut lengths = [0u8; 16];
            lengths[..8].copy_from_slice(&(aad.len() as u64 * 8).to_be_bytes());
            lengths[8..].copy_from_slice(&(len as u64 * 8).to_be_bytes());
            theirs.update(&[lengths.into()]);
            let theirs: [u8; 16] = theirs.finalize().into();
            assert_eq!(
                ours,
                theirs,
                "{len} bytes, {} of associated data",
                aad.len()
            );
        }
    }
}
