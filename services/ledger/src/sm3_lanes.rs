//! SM3 (GB/T 32905-2016) over many independent messages at once, one message per SIMD
//! lane: sixteen with AVX-512, eight with AVX2, one at a time (the `sm3` crate) elsewhere.
//!
//! Why: `verify` recomputes a million event hashes that do not depend on each other (each
//! names its `prev_hash` as stored), and SM3's rounds are serial within a message, so
//! lanes are the only way to use the vector units. Every result equals `sm3::Sm3`'s; the
//! tests compare them on random messages of every length around the block boundaries.

use sm3::{Digest, Sm3};

/// An SM3 digest (the ledger's `hashing::Hash`, named here so this module stands alone).
type Hash = [u8; 32];

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const IV: [u32; 8] = [
    0x7380_166f,
    0x4914_b2b9,
    0x1724_42d7,
    0xda8a_0600,
    0xa96f_30bc,
    0x1631_38aa,
    0xe38d_ee4d,
    0xb0fb_0e4e,
];

/// `T_j <<< (j mod 32)` for the 64 rounds.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const T_ROTATED: [u32; 64] = {
    let mut t = [0u32; 64];
    let mut j = 0;
    while j < 64 {
        let base: u32 = if j < 16 { 0x79cc_4519 } else { 0x7a87_9d8a };
        t[j] = base.rotate_left((j % 32) as u32);
        j += 1;
    }
    t
};

/// How the digests are computed: the widest lanes this CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lanes {
    /// Sixteen messages at a time (AVX-512F).
    Avx512,
    /// Eight messages at a time (AVX2).
    Avx2,
    /// One message at a time with the `sm3` crate.
    Portable,
}

impl Lanes {
    /// The widest kind this CPU supports.
    pub fn detect() -> Lanes {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Lanes::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Lanes::Avx2;
            }
        }
        Lanes::Portable
    }

    /// Whether this CPU can run `self`.
    pub fn supported(self) -> bool {
        match self {
            Lanes::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// The SM3 digest of every message, in order, on the widest lanes this CPU has. Fewer
/// messages than [`MIN_FOR_LANES`] go one at a time: lanes left empty cost as much as full
/// ones, and a lone message (a single `push`, the top levels of a Merkle page) is faster
/// alone.
pub fn sm3_many(messages: &[&[u8]]) -> Vec<Hash> {
    let lanes = if messages.len() < MIN_FOR_LANES {
        Lanes::Portable
    } else {
        Lanes::detect()
    };
    sm3_many_on(lanes, messages)
}

/// Below this many messages, lanes lose to one at a time (16 AVX-512 lanes hash about
/// five times as fast as one message alone, so three messages cost about the same).
pub const MIN_FOR_LANES: usize = 4;

/// [`sm3_many`] on the given lanes; falls back to [`Lanes::Portable`] where the CPU lacks
/// them, so the answer never depends on the choice.
pub fn sm3_many_on(lanes: Lanes, messages: &[&[u8]]) -> Vec<Hash> {
    let mut out = vec![[0u8; 32]; messages.len()];
    #[cfg(target_arch = "x86_64")]
    match lanes {
        Lanes::Avx512 if lanes.supported() => {
            // SAFETY: the CPU has AVX-512F (`supported`).
            unsafe { x86::many_avx512(messages, &mut out) };
            return out;
        }
        Lanes::Avx2 if lanes.supported() => {
            // SAFETY: the CPU has AVX2 (`supported`).
            unsafe { x86::many_avx2(messages, &mut out) };
            return out;
        }
        _ => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = lanes;
    for (m, o) in messages.iter().zip(out.iter_mut()) {
        *o = Sm3::digest(m).into();
    }
    out
}

/// One message's padded blocks: the whole blocks borrowed from it, the padded rest copied.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Padded<'a> {
    message: &'a [u8],
    whole: usize,
    tail: [u8; 128],
    blocks: usize,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl<'a> Padded<'a> {
    fn new(message: &'a [u8]) -> Self {
        let whole = message.len() / 64;
        let rest = &message[whole * 64..];
        let mut tail = [0u8; 128];
        tail[..rest.len()].copy_from_slice(rest);
        tail[rest.len()] = 0x80;
        let tail_blocks = if rest.len() + 9 <= 64 { 1 } else { 2 };
        let bits = (message.len() as u64).wrapping_mul(8);
        let end = tail_blocks * 64;
        tail[end - 8..end].copy_from_slice(&bits.to_be_bytes());
        Padded {
            message,
            whole,
            tail,
            blocks: whole + tail_blocks,
        }
    }

    /// Block `b`, or `None` past the end.
    fn block(&self, b: usize) -> Option<&[u8]> {
        if b < self.whole {
            Some(&self.message[b * 64..b * 64 + 64])
        } else if b < self.blocks {
            let t = (b - self.whole) * 64;
            Some(&self.tail[t..t + 64])
        } else {
            None
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Hash, IV, Padded, T_ROTATED};
    use std::arch::x86_64::*;

    /// The vector operations SM3's rounds need, over `N` 32-bit lanes.
    ///
    /// Safety: every method uses intrinsics of one target feature, so it may only run
    /// inlined into `many_avx512` or `many_avx2`, which enable it and are called only
    /// after the CPU was checked for it.
    trait Lanes: Copy {
        const N: usize;
        unsafe fn splat(x: u32) -> Self;
        unsafe fn load(words: &[u32]) -> Self;
        unsafe fn store(self, words: &mut [u32]);
        unsafe fn add(self, b: Self) -> Self;
        unsafe fn xor(self, b: Self) -> Self;
        unsafe fn xor3(self, b: Self, c: Self) -> Self;
        /// `(a & b) | (a & c) | (b & c)`
        unsafe fn majority(self, b: Self, c: Self) -> Self;
        /// `(a & b) | (!a & c)`
        unsafe fn choose(self, b: Self, c: Self) -> Self;
        /// Rotate left by `L` bits (`R` = 32 − `L`).
        unsafe fn rotl<const L: i32, const R: i32>(self) -> Self;
        /// Lanes whose bit is set in `mask` from `new`, the others from `self`.
        unsafe fn select(self, new: Self, mask: u32) -> Self;
    }

    #[derive(Clone, Copy)]
    struct Avx512(__m512i);

    impl Lanes for Avx512 {
        const N: usize = 16;
        #[inline(always)]
        unsafe fn splat(x: u32) -> Self {
            unsafe { Avx512(_mm512_set1_epi32(x as i32)) }
        }
        #[inline(always)]
        unsafe fn load(words: &[u32]) -> Self {
            debug_assert!(words.len() >= 16);
            Avx512(unsafe { _mm512_loadu_si512(words.as_ptr().cast()) })
        }
        #[inline(always)]
        unsafe fn store(self, words: &mut [u32]) {
            debug_assert!(words.len() >= 16);
            unsafe { _mm512_storeu_si512(words.as_mut_ptr().cast(), self.0) }
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            unsafe { Avx512(_mm512_add_epi32(self.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn xor(self, b: Self) -> Self {
            unsafe { Avx512(_mm512_xor_si512(self.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn xor3(self, b: Self, c: Self) -> Self {
            unsafe { Avx512(_mm512_ternarylogic_epi32::<0x96>(self.0, b.0, c.0)) }
        }
        #[inline(always)]
        unsafe fn majority(self, b: Self, c: Self) -> Self {
            unsafe { Avx512(_mm512_ternarylogic_epi32::<0xe8>(self.0, b.0, c.0)) }
        }
        #[inline(always)]
        unsafe fn choose(self, b: Self, c: Self) -> Self {
            unsafe { Avx512(_mm512_ternarylogic_epi32::<0xca>(self.0, b.0, c.0)) }
        }
        #[inline(always)]
        unsafe fn rotl<const L: i32, const R: i32>(self) -> Self {
            unsafe { Avx512(_mm512_rol_epi32::<L>(self.0)) }
        }
        #[inline(always)]
        unsafe fn select(self, new: Self, mask: u32) -> Self {
            unsafe { Avx512(_mm512_mask_blend_epi32(mask as u16, self.0, new.0)) }
        }
    }

    #[derive(Clone, Copy)]
    struct Avx2(__m256i);

    impl Lanes for Avx2 {
        const N: usize = 8;
        #[inline(always)]
        unsafe fn splat(x: u32) -> Self {
            unsafe { Avx2(_mm256_set1_epi32(x as i32)) }
        }
        #[inline(always)]
        unsafe fn load(words: &[u32]) -> Self {
            debug_assert!(words.len() >= 8);
            Avx2(unsafe { _mm256_loadu_si256(words.as_ptr().cast()) })
        }
        #[inline(always)]
        unsafe fn store(self, words: &mut [u32]) {
            debug_assert!(words.len() >= 8);
            unsafe { _mm256_storeu_si256(words.as_mut_ptr().cast(), self.0) }
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            unsafe { Avx2(_mm256_add_epi32(self.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn xor(self, b: Self) -> Self {
            unsafe { Avx2(_mm256_xor_si256(self.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn xor3(self, b: Self, c: Self) -> Self {
            unsafe { Avx2(_mm256_xor_si256(_mm256_xor_si256(self.0, b.0), c.0)) }
        }
        #[inline(always)]
        unsafe fn majority(self, b: Self, c: Self) -> Self {
            unsafe {
                // (a & b) | (c & (a | b))
                Avx2(_mm256_or_si256(
                    _mm256_and_si256(self.0, b.0),
                    _mm256_and_si256(c.0, _mm256_or_si256(self.0, b.0)),
                ))
            }
        }
        #[inline(always)]
        unsafe fn choose(self, b: Self, c: Self) -> Self {
            unsafe {
                // ((b ^ c) & a) ^ c
                Avx2(_mm256_xor_si256(
                    _mm256_and_si256(_mm256_xor_si256(b.0, c.0), self.0),
                    c.0,
                ))
            }
        }
        #[inline(always)]
        unsafe fn rotl<const L: i32, const R: i32>(self) -> Self {
            unsafe {
                Avx2(_mm256_or_si256(
                    _mm256_slli_epi32::<L>(self.0),
                    _mm256_srli_epi32::<R>(self.0),
                ))
            }
        }
        #[inline(always)]
        unsafe fn select(self, new: Self, mask: u32) -> Self {
            unsafe {
                let bits = _mm256_set_epi32(128, 64, 32, 16, 8, 4, 2, 1);
                let on = _mm256_cmpeq_epi32(
                    _mm256_and_si256(_mm256_set1_epi32(mask as i32), bits),
                    bits,
                );
                Avx2(_mm256_blendv_epi8(self.0, new.0, on))
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn many_avx512(messages: &[&[u8]], out: &mut [Hash]) {
        unsafe { many::<Avx512>(messages, out) }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn many_avx2(messages: &[&[u8]], out: &mut [Hash]) {
        unsafe { many::<Avx2>(messages, out) }
    }

    /// Hashes `messages` `V::N` at a time: each lane runs its message's padded blocks; a
    /// lane whose message has ended keeps its state (masked) while longer ones finish.
    #[inline(always)]
    unsafe fn many<V: Lanes>(messages: &[&[u8]], out: &mut [Hash]) {
        const ZERO: [u8; 64] = [0; 64];
        for (group, digests) in messages.chunks(V::N).zip(out.chunks_mut(V::N)) {
            let padded: Vec<Padded<'_>> = group.iter().map(|m| Padded::new(m)).collect();
            let blocks = padded.iter().map(|p| p.blocks).max().unwrap_or(0);
            let mut state = [unsafe { V::splat(0) }; 8];
            for (s, iv) in state.iter_mut().zip(IV) {
                *s = unsafe { V::splat(iv) };
            }
            // Word j of every lane's block, lanes side by side.
            let mut words = [[0u32; 16]; 16];
            for b in 0..blocks {
                let mut active = 0u32;
                for lane in 0..V::N {
                    let block = match padded.get(lane).and_then(|p| p.block(b)) {
                        Some(block) => {
                            active |= 1 << lane;
                            block
                        }
                        None => &ZERO[..],
                    };
                    for (j, w) in words.iter_mut().enumerate() {
                        w[lane] = u32::from_be_bytes([
                            block[4 * j],
                            block[4 * j + 1],
                            block[4 * j + 2],
                            block[4 * j + 3],
                        ]);
                    }
                }
                let next = unsafe { compress::<V>(&state, &words) };
                for (s, n) in state.iter_mut().zip(next) {
                    *s = unsafe { s.select(n, active) };
                }
            }
            let mut lanes = [[0u32; 16]; 8];
            for (s, l) in state.iter().zip(lanes.iter_mut()) {
                unsafe { s.store(l) };
            }
            for (lane, digest) in digests.iter_mut().enumerate() {
                for (i, l) in lanes.iter().enumerate() {
                    digest[4 * i..4 * i + 4].copy_from_slice(&l[lane].to_be_bytes());
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn p0<V: Lanes>(x: V) -> V {
        unsafe { x.xor3(x.rotl::<9, 23>(), x.rotl::<17, 15>()) }
    }

    #[inline(always)]
    unsafe fn p1<V: Lanes>(x: V) -> V {
        unsafe { x.xor3(x.rotl::<15, 17>(), x.rotl::<23, 9>()) }
    }

    /// One compression of every lane's state with its block.
    #[inline(always)]
    unsafe fn compress<V: Lanes>(state: &[V; 8], words: &[[u32; 16]; 16]) -> [V; 8] {
        unsafe {
            let mut w = [V::splat(0); 68];
            for (wj, block_words) in w.iter_mut().zip(words) {
                *wj = V::load(block_words);
            }
            for j in 16..68 {
                let x = w[j - 16].xor3(w[j - 9], w[j - 3].rotl::<15, 17>());
                w[j] = p1(x).xor3(w[j - 13].rotl::<7, 25>(), w[j - 6]);
            }
            let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = *state;
            macro_rules! round {
                ($j:expr, $ff:ident, $gg:ident) => {{
                    let j = $j;
                    let a12 = a.rotl::<12, 20>();
                    let ss1 = a12.add(e).add(V::splat(T_ROTATED[j])).rotl::<7, 25>();
                    let ss2 = ss1.xor(a12);
                    let tt1 = a.$ff(b, c).add(d).add(ss2).add(w[j].xor(w[j + 4]));
                    let tt2 = e.$gg(f, g).add(h).add(ss1).add(w[j]);
                    d = c;
                    c = b.rotl::<9, 23>();
                    b = a;
                    a = tt1;
                    h = g;
                    g = f.rotl::<19, 13>();
                    f = e;
                    e = p0(tt2);
                }};
            }
            for j in 0..16 {
                round!(j, xor3, xor3);
            }
            for j in 16..64 {
                round!(j, majority, choose);
            }
            [
                a.xor(state[0]),
                b.xor(state[1]),
                c.xor(state[2]),
                d.xor(state[3]),
                e.xor(state[4]),
                f.xor(state[5]),
                g.xor(state[6]),
                h.xor(state[7]),
            ]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ALL: [Lanes; 3] = [Lanes::Avx512, Lanes::Avx2, Lanes::Portable];

    fn reference(messages: &[Vec<u8>]) -> Vec<Hash> {
        messages.iter().map(|m| Sm3::digest(m).into()).collect()
    }

    fn on(lanes: Lanes, messages: &[Vec<u8>]) -> Vec<Hash> {
        let refs: Vec<&[u8]> = messages.iter().map(Vec::as_slice).collect();
        sm3_many_on(lanes, &refs)
    }

    #[test]
    fn the_standard_vectors_on_every_kind_of_lanes() {
        // GB/T 32905-2016, appendix A: "abc" and "abcd" repeated 16 times.
        let abc = hex::decode("66c7f0f462eeedd9d1f2d46bdc10e4e24167c4875cf2f7a2297da02b8f4ba8e0");
        let abcd = hex::decode("debe9ff92275b8a138604889c18e5a4d6fdb70e5387e5765293dcba39c0c5732");
        let messages = vec![b"abc".to_vec(), b"abcd".repeat(16)];
        for lanes in ALL {
            let got = on(lanes, &messages);
            assert_eq!(got[0].to_vec(), abc.clone().unwrap(), "{lanes:?}");
            assert_eq!(got[1].to_vec(), abcd.clone().unwrap(), "{lanes:?}");
        }
    }

    #[test]
    fn every_length_across_the_block_and_padding_boundaries() {
        // 0..=200 bytes covers an empty message, 55/56 (the length field spills into a
        // second block), 63/64/65 and three blocks; lanes of different lengths finish at
        // different blocks.
        let messages: Vec<Vec<u8>> = (0..=200u32)
            .map(|n| (0..n).map(|i| (i * 7 + n) as u8).collect())
            .collect();
        let want = reference(&messages);
        for lanes in ALL {
            assert_eq!(on(lanes, &messages), want, "{lanes:?}");
        }
    }

    #[test]
    fn the_detected_lanes_are_supported() {
        assert!(Lanes::detect().supported());
        assert!(Lanes::Portable.supported());
    }

    proptest! {
        #[test]
        fn equals_the_sm3_crate_for_any_messages(
            messages in proptest::collection::vec(
                proptest::collection::vec(any::<u8>(), 0..700), 0..40),
        ) {
            let want = reference(&messages);
            for lanes in ALL {
                prop_assert_eq!(on(lanes, &messages), want.clone(), "{:?}", lanes);
            }
        }
    }
}
