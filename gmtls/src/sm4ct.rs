//! SM4 (GB/T 32907-2016) without secret-indexed tables, many blocks at a time, on the CPU's
//! GFNI or AES instructions.
//!
//! The `sm4` crate computes the S-box by table lookups indexed by key- and data-dependent
//! bytes: a process sharing the CPU's caches could learn about the key by timing, and it
//! encrypts one block at a time. Both SM4's and AES's S-boxes are an inversion in GF(2⁸)
//! between affine maps, over different field polynomials (SM4: x⁸+x⁷+x⁶+x⁵+x⁴+x²+1, AES:
//! x⁸+x⁴+x³+x+1), and the two fields are isomorphic. So
//!
//! S_SM4(x) = M₂ · S_AES(M₁ · x ⊕ c₁) ⊕ c₂
//!
//! with M₁ = T·A and c₁ = T·c (A, c: SM4's affine map and constant 0xD3; T: the field
//! isomorphism, x ↦ β where β is a root of SM4's polynomial in AES's field), and
//! M₂ = A·T⁻¹·A_AES⁻¹, c₂ = M₂·0x63 ⊕ c. The affine maps are applied with `pshufb` on the
//! two nibbles of each byte (a lookup in a register, not in memory) and S_AES with
//! `aesenclast` (its ShiftRows undone beforehand): every step takes the same time whatever
//! the data. The nibble tables below were derived that way by us and are checked, with the
//! whole cipher, against the `sm4` crate on random keys and blocks and against GB/T
//! 32907's example (`tests/vectors.rs`).
//!
//! Where the CPU has GFNI and AVX-512, the same two affine maps and the inversion are two
//! instructions on sixteen blocks' words at once (module `gfni`); the AES-NI path
//! remains for CPUs without them. Where the CPU lacks AES-NI or SSSE3 (or off x86-64)
//! [`Sm4Ct`] falls back to the `sm4` crate, with its table lookups; [`Sm4Ct::kernel`] says
//! which is in use.

use sm4::cipher::consts::{U8, U16};
use sm4::cipher::{
    AlgorithmName, Block, BlockCipherEncBackend, BlockCipherEncClosure, BlockCipherEncrypt,
    BlockSizeUser, InOut, InOutBuf, Key, KeyInit, KeySizeUser, ParBlocks, ParBlocksSizeUser,
};

/// GB/T 32907's system parameter FK.
const FK: [u32; 4] = [0xA3B1_BAC6, 0x56AA_3350, 0x677D_9197, 0xB270_22DC];

/// GB/T 32907's constant CKᵢ: bytes (4i + j) · 7 mod 256, j = 0..3, big-endian.
fn ck(i: usize) -> u32 {
    let byte = |j: usize| (((4 * i + j) * 7) % 256) as u32;
    (byte(0) << 24) | (byte(1) << 16) | (byte(2) << 8) | byte(3)
}

/// M₁ · n ⊕ c₁ for a low nibble n, and M₁ · (n << 4) for a high one.
const M1_LO: [u8; 16] = [
    0x3e, 0xb2, 0x0e, 0x82, 0xbb, 0x37, 0x8b, 0x07, 0xa1, 0x2d, 0x91, 0x1d, 0x24, 0xa8, 0x14, 0x98,
];
const M1_HI: [u8; 16] = [
    0x00, 0xdc, 0x2e, 0xf2, 0xc5, 0x19, 0xeb, 0x37, 0x08, 0xd4, 0x26, 0xfa, 0xcd, 0x11, 0xe3, 0x3f,
];
/// M₂ · n ⊕ c₂ for a low nibble n, and M₂ · (n << 4) for a high one.
const M2_LO: [u8; 16] = [
    0x6c, 0xd4, 0xa6, 0x1e, 0x52, 0xea, 0x98, 0x20, 0x0b, 0xb3, 0xc1, 0x79, 0x35, 0x8d, 0xff, 0x47,
];
const M2_HI: [u8; 16] = [
    0x00, 0xe0, 0x50, 0xb0, 0x9d, 0x7d, 0xcd, 0x2d, 0xc0, 0x20, 0x90, 0x70, 0x5d, 0xbd, 0x0d, 0xed,
];

/// SM4 encryption for GCM: constant time with AES-NI, eight blocks in parallel.
#[derive(Clone)]
pub struct Sm4Ct {
    imp: Imp,
}

#[derive(Clone)]
enum Imp {
    /// Round keys for the GFNI path (AVX-512).
    Gfni([u32; 32]),
    /// Round keys for the AES-NI path.
    Ni([u32; 32]),
    /// The `sm4` crate, where the AES instructions are missing.
    Tables(sm4::Sm4),
}

/// How an [`Sm4Ct`] computes: which instructions carry the S-box.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// GFNI's affine-inverse instruction on AVX-512 registers, 16 blocks a register group.
    Gfni,
    /// AES-NI's `aesenclast` between `pshufb` affine maps, 4 blocks a register group.
    AesNi,
    /// The `sm4` crate's table lookups (not constant time).
    Tables,
}

impl Sm4Ct {
    /// Whether this instance runs without secret-indexed tables (GFNI or AES-NI found).
    pub fn constant_time(&self) -> bool {
        self.kernel() != Kernel::Tables
    }

    /// Which instructions this instance uses.
    pub fn kernel(&self) -> Kernel {
        match self.imp {
            Imp::Gfni(_) => Kernel::Gfni,
            Imp::Ni(_) => Kernel::AesNi,
            Imp::Tables(_) => Kernel::Tables,
        }
    }

    /// The round keys where this instance runs the GFNI kernel: GCM uses its counter mode
    /// ([`gfni_ctr`]) directly.
    pub(crate) fn gfni_round_keys(&self) -> Option<&[u32; 32]> {
        match &self.imp {
            Imp::Gfni(rk) => Some(rk),
            _ => None,
        }
    }

    /// The table-based `sm4` crate whatever the CPU: for comparing the two.
    pub fn with_tables(key: &[u8; 16]) -> Self {
        Sm4Ct {
            imp: Imp::Tables(sm4::Sm4::new(key.into())),
        }
    }

    /// The AES-NI kernel even where GFNI is there (for comparing them); `None` without
    /// AES-NI.
    pub fn with_aes_ni(key: &[u8; 16]) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if ni::available() {
            // SAFETY: the CPU has AES-NI and SSSE3 (checked just above).
            let rk = unsafe { ni::round_keys(words(key)) };
            return Some(Sm4Ct { imp: Imp::Ni(rk) });
        }
        let _ = key;
        None
    }

    /// Encrypts `blocks` in place (ECB: the caller makes them counter blocks), as many at
    /// a time as the kernel takes, the last few in one pass: a pass costs about the same
    /// for one block as for all it holds.
    pub fn encrypt_in_place(&self, blocks: &mut [[u8; 16]]) {
        match &self.imp {
            #[cfg(target_arch = "x86_64")]
            Imp::Gfni(rk) => {
                let mut chunks = blocks.chunks_exact_mut(gfni::WIDE);
                for chunk in chunks.by_ref() {
                    // SAFETY: an `Imp::Gfni` is only made where the CPU has the features
                    // `gfni::available` checks.
                    unsafe { gfni::encrypt(rk, chunk) };
                }
                let tail = chunks.into_remainder();
                if !tail.is_empty() {
                    // SAFETY: as above.
                    unsafe { gfni::encrypt(rk, tail) };
                }
            }
            #[cfg(target_arch = "x86_64")]
            Imp::Ni(rk) => {
                let mut chunks = blocks.chunks_exact_mut(8);
                for chunk in chunks.by_ref() {
                    let mut eight = [[0u8; 16]; 8];
                    eight.copy_from_slice(chunk);
                    // SAFETY: an `Imp::Ni` is only made where the CPU has AES-NI and SSSE3.
                    unsafe { ni::encrypt8(rk, &mut eight) };
                    chunk.copy_from_slice(&eight);
                }
                let tail = chunks.into_remainder();
                let n = tail.len();
                if n > 0 {
                    let mut eight = [[0u8; 16]; 8];
                    eight[..n].copy_from_slice(tail);
                    if let (true, Some(four)) = (n <= 4, eight.first_chunk_mut::<4>()) {
                        // SAFETY: as above.
                        unsafe { ni::encrypt4(rk, four) };
                    } else {
                        // SAFETY: as above.
                        unsafe { ni::encrypt8(rk, &mut eight) };
                    }
                    tail.copy_from_slice(&eight[..n]);
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Imp::Gfni(_) | Imp::Ni(_) => unreachable!("the SIMD paths are made on x86-64 only"),
            Imp::Tables(cipher) => {
                for block in blocks {
                    let mut one = Block::<Sm4Ct>::from(*block);
                    BlockCipherEncrypt::encrypt_block(cipher, &mut one);
                    block.copy_from_slice(&one);
                }
            }
        }
    }
}

/// GCM's counter mode on the GFNI kernel (see `gfni::ctr`): `data` XORed with the keystream
/// from counter 2 on; SM4 of counter 1, the tag mask, returned.
#[cfg(target_arch = "x86_64")]
pub(crate) fn gfni_ctr(rk: &[u32; 32], nonce: &[u8; 12], data: &mut [u8]) -> [u8; 16] {
    // SAFETY: round keys for the GFNI kernel exist only where `gfni::available` held.
    unsafe { gfni::ctr(rk, nonce, data) }
}

/// The key as four big-endian words.
fn words(key: &[u8; 16]) -> [u32; 4] {
    let mut mk = [0u32; 4];
    for (word, bytes) in mk.iter_mut().zip(key.chunks_exact(4)) {
        *word = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    }
    mk
}

impl Drop for Sm4Ct {
    /// The round keys are the key: wiped when the cipher goes (the table path's own
    /// cipher wipes itself, the `sm4` crate's `zeroize` feature).
    fn drop(&mut self) {
        if let Imp::Ni(rk) | Imp::Gfni(rk) = &mut self.imp {
            zeroize::Zeroize::zeroize(rk);
        }
    }
}

impl std::fmt::Debug for Sm4Ct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sm4Ct")
            .field("constant_time", &self.constant_time())
            .finish_non_exhaustive()
    }
}

impl KeySizeUser for Sm4Ct {
    type KeySize = U16;
}

impl KeyInit for Sm4Ct {
    fn new(key: &Key<Self>) -> Self {
        let key: &[u8; 16] = key.as_ref();
        #[cfg(target_arch = "x86_64")]
        if let Some(ni) = Sm4Ct::with_aes_ni(key) {
            if let (true, Imp::Ni(rk)) = (gfni::available(), &ni.imp) {
                return Sm4Ct {
                    imp: Imp::Gfni(*rk),
                };
            }
            return ni;
        }
        Sm4Ct {
            imp: Imp::Tables(sm4::Sm4::new(key.into())),
        }
    }
}

impl BlockSizeUser for Sm4Ct {
    type BlockSize = U16;
}

impl ParBlocksSizeUser for Sm4Ct {
    type ParBlocksSize = U8;
}

impl AlgorithmName for Sm4Ct {
    fn write_alg_name(f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SM4")
    }
}

impl BlockCipherEncrypt for Sm4Ct {
    fn encrypt_with_backend(&self, f: impl BlockCipherEncClosure<BlockSize = Self::BlockSize>) {
        f.call(self)
    }
}

impl BlockCipherEncBackend for Sm4Ct {
    fn encrypt_block(&self, mut block: InOut<'_, '_, Block<Self>>) {
        let mut one = [[0u8; 16]; 1];
        one[0].copy_from_slice(block.get_in());
        self.encrypt_in_place(&mut one);
        block.get_out().copy_from_slice(&one[0]);
    }

    fn encrypt_par_blocks(&self, mut blocks: InOut<'_, '_, ParBlocks<Self>>) {
        let mut eight = [[0u8; 16]; 8];
        for (out, block) in eight.iter_mut().zip(blocks.get_in().iter()) {
            out.copy_from_slice(block);
        }
        self.encrypt_in_place(&mut eight);
        for (block, out) in blocks.get_out().iter_mut().zip(eight.iter()) {
            block.copy_from_slice(out);
        }
    }

    /// The last blocks of a message (fewer than eight) in one parallel pass rather than one
    /// pass each: a pass costs the same for one block as for four.
    fn encrypt_tail_blocks(&self, mut blocks: InOutBuf<'_, '_, Block<Self>>) {
        let n = blocks.len();
        let mut eight = [[0u8; 16]; 8];
        for (out, block) in eight.iter_mut().zip(blocks.get_in().iter()) {
            out.copy_from_slice(block);
        }
        self.encrypt_in_place(&mut eight[..n]);
        for (block, out) in blocks.get_out().iter_mut().zip(eight.iter()) {
            block.copy_from_slice(out);
        }
    }
}

/// The AES-NI path.
#[cfg(target_arch = "x86_64")]
mod ni {
    use std::arch::x86_64::*;

    use super::{FK, M1_HI, M1_LO, M2_HI, M2_LO, ck};

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("ssse3")
    }

    #[inline(always)]
    fn table(bytes: &[u8; 16]) -> __m128i {
        // SAFETY: an unaligned load of 16 bytes from a 16-byte array.
        unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) }
    }

    /// S-box on every byte of `x`, in constant time (see the module's documentation).
    #[inline]
    #[target_feature(enable = "aes,ssse3")]
    fn tau(x: __m128i) -> __m128i {
        let nibble = _mm_set1_epi8(0x0f);
        // pshufb picks byte j of its input for output byte i where mask[i] = j: undoes the
        // ShiftRows that aesenclast applies after SubBytes.
        let inv_shift_rows = _mm_setr_epi8(0, 13, 10, 7, 4, 1, 14, 11, 8, 5, 2, 15, 12, 9, 6, 3);
        let lo = _mm_and_si128(x, nibble);
        let hi = _mm_and_si128(_mm_srli_epi16(x, 4), nibble);
        let y = _mm_xor_si128(
            _mm_shuffle_epi8(table(&M1_LO), lo),
            _mm_shuffle_epi8(table(&M1_HI), hi),
        );
        let y = _mm_aesenclast_si128(_mm_shuffle_epi8(y, inv_shift_rows), _mm_setzero_si128());
        let lo = _mm_and_si128(y, nibble);
        let hi = _mm_and_si128(_mm_srli_epi16(y, 4), nibble);
        _mm_xor_si128(
            _mm_shuffle_epi8(table(&M2_LO), lo),
            _mm_shuffle_epi8(table(&M2_HI), hi),
        )
    }

    macro_rules! rotl {
        ($x:expr, $n:literal) => {
            _mm_or_si128(_mm_slli_epi32($x, $n), _mm_srli_epi32($x, 32 - $n))
        };
    }

    /// The key schedule: T' = L'(τ(·)), L'(B) = B ⊕ (B ⋘ 13) ⊕ (B ⋘ 23).
    #[target_feature(enable = "aes,ssse3")]
    pub fn round_keys(mk: [u32; 4]) -> [u32; 32] {
        let mut k = [mk[0] ^ FK[0], mk[1] ^ FK[1], mk[2] ^ FK[2], mk[3] ^ FK[3]];
        let mut rk = [0u32; 32];
        for (i, out) in rk.iter_mut().enumerate() {
            let a = k[(i + 1) % 4] ^ k[(i + 2) % 4] ^ k[(i + 3) % 4] ^ ck(i);
            let b = _mm_cvtsi128_si32(tau(_mm_cvtsi32_si128(a as i32))) as u32;
            let next = k[i % 4] ^ b ^ b.rotate_left(13) ^ b.rotate_left(23);
            k[i % 4] = next;
            *out = next;
        }
        rk
    }

    /// Big-endian words.
    #[inline(always)]
    fn swap() -> __m128i {
        // SAFETY: SSE2 is part of x86-64.
        unsafe { _mm_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12) }
    }

    /// The 4×4 matrix of 32-bit words transposed: register j of the result holds word j of
    /// each input register. Four blocks become four registers of like words, and back.
    #[inline]
    #[target_feature(enable = "aes,ssse3")]
    fn transpose(r: [__m128i; 4]) -> [__m128i; 4] {
        let (t0, t1) = (
            _mm_unpacklo_epi32(r[0], r[1]),
            _mm_unpacklo_epi32(r[2], r[3]),
        );
        let (t2, t3) = (
            _mm_unpackhi_epi32(r[0], r[1]),
            _mm_unpackhi_epi32(r[2], r[3]),
        );
        [
            _mm_unpacklo_epi64(t0, t1),
            _mm_unpackhi_epi64(t0, t1),
            _mm_unpacklo_epi64(t2, t3),
            _mm_unpackhi_epi64(t2, t3),
        ]
    }

    /// Four blocks as four registers, register j holding (big-endian) word j of each block.
    #[inline]
    #[target_feature(enable = "aes,ssse3")]
    fn load(blocks: &[[u8; 16]]) -> [__m128i; 4] {
        transpose(std::array::from_fn(|i| {
            _mm_shuffle_epi8(table(&blocks[i]), swap())
        }))
    }

    /// The four blocks back from their registers after 32 rounds: output words X35, X34,
    /// X33, X32 are x[3], x[2], x[1], x[0].
    #[inline]
    #[target_feature(enable = "aes,ssse3")]
    fn store(x: &[__m128i; 4], blocks: &mut [[u8; 16]]) {
        let out = transpose([x[3], x[2], x[1], x[0]]);
        for (block, word) in blocks.iter_mut().zip(out) {
            let bytes = _mm_shuffle_epi8(word, swap());
            // SAFETY: an unaligned store of 16 bytes into a 16-byte array.
            unsafe { _mm_storeu_si128(block.as_mut_ptr().cast(), bytes) };
        }
    }

    /// L(B) = B ⊕ (B ⋘ 2) ⊕ (B ⋘ 10) ⊕ (B ⋘ 18) ⊕ (B ⋘ 24), computed as
    /// B ⊕ (B ⋘ 24) ⊕ ((B ⊕ (B ⋘ 8) ⊕ (B ⋘ 16)) ⋘ 2): the byte rotations are shuffles.
    #[inline]
    #[target_feature(enable = "aes,ssse3")]
    fn linear(b: __m128i) -> __m128i {
        let rol8 = _mm_setr_epi8(3, 0, 1, 2, 7, 4, 5, 6, 11, 8, 9, 10, 15, 12, 13, 14);
        let rol16 = _mm_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
        let rol24 = _mm_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12);
        let t = _mm_xor_si128(
            b,
            _mm_xor_si128(_mm_shuffle_epi8(b, rol8), _mm_shuffle_epi8(b, rol16)),
        );
        _mm_xor_si128(_mm_xor_si128(b, _mm_shuffle_epi8(b, rol24)), rotl!(t, 2))
    }

    /// One round's T on a group: L(τ(a ⊕ b ⊕ c ⊕ key)).
    #[inline]
    #[target_feature(enable = "aes,ssse3")]
    fn t(a: __m128i, b: __m128i, c: __m128i, key: __m128i) -> __m128i {
        linear(tau(_mm_xor_si128(
            _mm_xor_si128(a, b),
            _mm_xor_si128(c, key),
        )))
    }

    /// The 32 rounds on a group of four blocks (X_{i+4} = X_i ⊕ T(X_{i+1} ⊕ X_{i+2} ⊕
    /// X_{i+3} ⊕ rk_i)), unrolled by four so that the words stay in registers.
    #[inline]
    #[target_feature(enable = "aes,ssse3")]
    fn rounds(rk: &[u32; 32], x: [__m128i; 4]) -> [__m128i; 4] {
        let [mut x0, mut x1, mut x2, mut x3] = x;
        for k in rk.chunks_exact(4) {
            let key = |j: usize| _mm_set1_epi32(k[j] as i32);
            x0 = _mm_xor_si128(x0, t(x1, x2, x3, key(0)));
            x1 = _mm_xor_si128(x1, t(x2, x3, x0, key(1)));
            x2 = _mm_xor_si128(x2, t(x3, x0, x1, key(2)));
            x3 = _mm_xor_si128(x3, t(x0, x1, x2, key(3)));
        }
        [x0, x1, x2, x3]
    }

    /// Two groups' rounds interleaved: each round is a chain of dependent steps, and two
    /// independent chains keep the CPU's units busy.
    #[inline]
    #[target_feature(enable = "aes,ssse3")]
    fn rounds2(rk: &[u32; 32], x: [__m128i; 4], y: [__m128i; 4]) -> ([__m128i; 4], [__m128i; 4]) {
        let [mut x0, mut x1, mut x2, mut x3] = x;
        let [mut y0, mut y1, mut y2, mut y3] = y;
        for k in rk.chunks_exact(4) {
            let key = |j: usize| _mm_set1_epi32(k[j] as i32);
            x0 = _mm_xor_si128(x0, t(x1, x2, x3, key(0)));
            y0 = _mm_xor_si128(y0, t(y1, y2, y3, key(0)));
            x1 = _mm_xor_si128(x1, t(x2, x3, x0, key(1)));
            y1 = _mm_xor_si128(y1, t(y2, y3, y0, key(1)));
            x2 = _mm_xor_si128(x2, t(x3, x0, x1, key(2)));
            y2 = _mm_xor_si128(y2, t(y3, y0, y1, key(2)));
            x3 = _mm_xor_si128(x3, t(x0, x1, x2, key(3)));
            y3 = _mm_xor_si128(y3, t(y0, y1, y2, key(3)));
        }
        ([x0, x1, x2, x3], [y0, y1, y2, y3])
    }

    /// Encrypts four blocks in place: word j of the four blocks sits in one register, so
    /// each round's S-box and linear map run on the four blocks at once.
    #[target_feature(enable = "aes,ssse3")]
    pub fn encrypt4(rk: &[u32; 32], blocks: &mut [[u8; 16]; 4]) {
        let x = rounds(rk, load(blocks));
        store(&x, blocks);
    }

    /// Encrypts eight blocks in place, two groups of four whose rounds interleave: each
    /// round is a chain of dependent steps, and two chains keep the CPU's units busy.
    #[target_feature(enable = "aes,ssse3")]
    pub fn encrypt8(rk: &[u32; 32], blocks: &mut [[u8; 16]; 8]) {
        let (first, second) = blocks.split_at_mut(4);
        let (x, y) = rounds2(rk, load(first), load(second));
        store(&x, first);
        store(&y, second);
    }
}

/// The GFNI path: the S-box is one affine map and one affine-inverse instruction
/// (`gf2p8affineqb`, `gf2p8affineinvqb`: an inversion in AES's field between affine maps,
/// the same decomposition as the AES-NI path's, with the matrices taken from the same
/// nibble tables), on AVX-512 registers of sixteen words: sixteen blocks a group, up to
/// three groups' rounds interleaved (a 600-byte TLS record's keystream and tag mask, 39
/// blocks, in one pass).
#[cfg(target_arch = "x86_64")]
pub(crate) mod gfni {
    use std::arch::x86_64::*;

    use super::{M1_HI, M1_LO, M2_HI, M2_LO};

    /// Blocks a call takes at most: three groups of sixteen.
    pub const WIDE: usize = 48;
    const GROUP: usize = 16;

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("gfni")
    }

    /// A linear map on bytes, given by its columns (`columns[j]` = the image of bit j), as
    /// GFNI's matrix operand: the row of output bit i in byte 7 − i.
    const fn matrix(columns: [u8; 8]) -> i64 {
        let mut m = 0u64;
        let mut i = 0;
        while i < 8 {
            let mut row = 0u8;
            let mut j = 0;
            while j < 8 {
                if columns[j] >> i & 1 == 1 {
                    row |= 1 << j;
                }
                j += 1;
            }
            m |= (row as u64) << (8 * (7 - i));
            i += 1;
        }
        m as i64
    }

    /// M₁'s linear part, column j.
    const fn m1(j: usize) -> u8 {
        if j < 4 {
            M1_LO[1 << j] ^ M1_LO[0]
        } else {
            M1_HI[1 << (j - 4)]
        }
    }

    /// M₂'s linear part applied to a byte.
    const fn m2(x: u8) -> u8 {
        M2_LO[(x & 15) as usize] ^ M2_HI[(x >> 4) as usize] ^ M2_LO[0]
    }

    /// AES's affine map, linear part: x ⊕ (x ⋘ 1) ⊕ (x ⋘ 2) ⊕ (x ⋘ 3) ⊕ (x ⋘ 4).
    const fn aes_linear(x: u8) -> u8 {
        x ^ x.rotate_left(1) ^ x.rotate_left(2) ^ x.rotate_left(3) ^ x.rotate_left(4)
    }

    const fn columns(f: u8) -> [u8; 8] {
        let mut c = [0u8; 8];
        let mut j = 0;
        while j < 8 {
            c[j] = match f {
                1 => m1(j),
                _ => m2(aes_linear(1 << j)),
            };
            j += 1;
        }
        c
    }

    /// y = M₁·x ⊕ c₁ ...
    const M1: i64 = matrix(columns(1));
    const C1: i32 = M1_LO[0] as i32;
    /// ... then S(x) = M₂·S_AES(y) ⊕ c₂ = (M₂·A)·y⁻¹ ⊕ (M₂·0x63 ⊕ c₂), A being AES's
    /// affine map: M₂·0x63 ⊕ c₂ is the tables' entries for the nibbles 6 and 3.
    const M2A: i64 = matrix(columns(2));
    const C2: i32 = (M2_LO[3] ^ M2_HI[6]) as i32;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    fn tau(x: __m512i) -> __m512i {
        let y = _mm512_gf2p8affine_epi64_epi8::<C1>(x, _mm512_set1_epi64(M1));
        _mm512_gf2p8affineinv_epi64_epi8::<C2>(y, _mm512_set1_epi64(M2A))
    }

    /// Byte shuffles that rotate each word left by 8, 16 and 24 bits. Hidden from the
    /// optimiser (`black_box`): it would turn them back into bit rotations, which compete
    /// with the GFNI instructions for one port while shuffles run on another.
    #[derive(Clone, Copy)]
    struct ByteRotations([__m512i; 3]);

    impl ByteRotations {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,gfni")]
        fn new() -> Self {
            let order = |k: i8| {
                let at = |i: i8| (i & !3) | ((i - k) & 3);
                _mm512_broadcast_i32x4(_mm_setr_epi8(
                    at(0),
                    at(1),
                    at(2),
                    at(3),
                    at(4),
                    at(5),
                    at(6),
                    at(7),
                    at(8),
                    at(9),
                    at(10),
                    at(11),
                    at(12),
                    at(13),
                    at(14),
                    at(15),
                ))
            };
            std::hint::black_box(ByteRotations([order(1), order(2), order(3)]))
        }

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,gfni")]
        fn rol<const K: usize>(self, x: __m512i) -> __m512i {
            _mm512_shuffle_epi8(x, self.0[K - 1])
        }
    }

    /// X₀ ⊕ L(τ(a)), a = X₁ ⊕ X₂ ⊕ X₃ ⊕ rk, L(B) = B ⊕ (B ⋘ 2) ⊕ (B ⋘ 10) ⊕ (B ⋘ 18) ⊕
    /// (B ⋘ 24), computed as B ⊕ (B ⋘ 24) ⊕ ((B ⊕ (B ⋘ 8) ⊕ (B ⋘ 16)) ⋘ 2): the whole-byte
    /// rotations are byte shuffles, which run on another port than the bit rotation and the
    /// GFNI instructions (one bit rotation a round instead of four).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    fn round(x0: __m512i, a: __m512i, bytes: ByteRotations) -> __m512i {
        let b = tau(a);
        let spread = _mm512_ternarylogic_epi32::<XOR3>(b, bytes.rol::<1>(b), bytes.rol::<2>(b));
        let high = _mm512_ternarylogic_epi32::<XOR3>(x0, b, bytes.rol::<3>(b));
        _mm512_xor_si512(high, _mm512_rol_epi32::<2>(spread))
    }

    /// `ternarylogic`'s table for a ⊕ b ⊕ c.
    const XOR3: i32 = 0x96;

    /// Big-endian words, in each 128-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    fn swap(x: __m512i) -> __m512i {
        let order = _mm512_broadcast_i32x4(_mm_setr_epi8(
            3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12,
        ));
        _mm512_shuffle_epi8(x, order)
    }

    /// In each 128-bit lane, the 4×4 matrix of words of the four registers transposed:
    /// register j then holds word j of the four blocks that lane held (as the AES-NI path's
    /// transpose, lane by lane).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    fn transpose(r: [__m512i; 4]) -> [__m512i; 4] {
        let (t0, t1) = (
            _mm512_unpacklo_epi32(r[0], r[1]),
            _mm512_unpacklo_epi32(r[2], r[3]),
        );
        let (t2, t3) = (
            _mm512_unpackhi_epi32(r[0], r[1]),
            _mm512_unpackhi_epi32(r[2], r[3]),
        );
        [
            _mm512_unpacklo_epi64(t0, t1),
            _mm512_unpackhi_epi64(t0, t1),
            _mm512_unpacklo_epi64(t2, t3),
            _mm512_unpackhi_epi64(t2, t3),
        ]
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    fn load(group: &[[u8; 16]; GROUP]) -> [__m512i; 4] {
        transpose(std::array::from_fn(|i| {
            // SAFETY: an unaligned load of 64 bytes from four 16-byte blocks in a row.
            swap(unsafe { _mm512_loadu_si512(group[4 * i..].as_ptr().cast()) })
        }))
    }

    /// The blocks back after 32 rounds: output words X35, X34, X33, X32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    fn store(x: [__m512i; 4], group: &mut [[u8; 16]; GROUP]) {
        for (i, r) in transpose([x[3], x[2], x[1], x[0]]).into_iter().enumerate() {
            // SAFETY: an unaligned store of 64 bytes into four 16-byte blocks in a row.
            unsafe { _mm512_storeu_si512(group[4 * i..].as_mut_ptr().cast(), swap(r)) };
        }
    }

    /// The 32 rounds on `G` groups, their steps interleaved: each round is a chain of
    /// dependent steps, and independent groups keep the CPU's units busy.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    fn rounds<const G: usize>(rk: &[u32; 32], mut x: [[__m512i; 4]; G]) -> [[__m512i; 4]; G] {
        let bytes = ByteRotations::new();
        for k in rk.chunks_exact(4) {
            pair::<0, G>(&mut x, k[0], k[1], bytes);
            pair::<2, G>(&mut x, k[2], k[3], bytes);
        }
        x
    }

    /// Rounds r and r + 1 (r mod 4 = `J`: round r replaces register J), which both take
    /// Xᵣ₊₂ ⊕ Xᵣ₊₃, XORed once. `J` a constant, so that the registers stay registers.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    fn pair<const J: usize, const G: usize>(
        x: &mut [[__m512i; 4]; G],
        k0: u32,
        k1: u32,
        bytes: ByteRotations,
    ) {
        let (k0, k1) = (_mm512_set1_epi32(k0 as i32), _mm512_set1_epi32(k1 as i32));
        for g in x.iter_mut() {
            let shared = _mm512_xor_si512(g[(J + 2) % 4], g[(J + 3) % 4]);
            let a = _mm512_ternarylogic_epi32::<XOR3>(shared, g[J + 1], k0);
            g[J] = round(g[J], a, bytes);
            let a = _mm512_ternarylogic_epi32::<XOR3>(shared, g[J], k1);
            g[J + 1] = round(g[J + 1], a, bytes);
        }
    }

    /// Encrypts up to [`WIDE`] blocks in place, in as many groups of sixteen as they fill
    /// (one, two or three), whose rounds interleave. Whole groups are loaded from and
    /// stored to `blocks` directly; only a last, partial group goes through a padded copy.
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    pub fn encrypt(rk: &[u32; 32], blocks: &mut [[u8; 16]]) {
        let n = blocks.len().min(WIDE);
        let (whole, tail) = blocks[..n].split_at_mut(n - n % GROUP);
        let mut pad = [[0u8; 16]; GROUP];
        pad[..tail.len()].copy_from_slice(tail);
        let partial = (!tail.is_empty()).then_some(&mut pad);
        let mut groups = whole
            .chunks_exact_mut(GROUP)
            .map(|g| <&mut [[u8; 16]; GROUP]>::try_from(g).expect("sixteen blocks"))
            .chain(partial);
        match (groups.next(), groups.next(), groups.next()) {
            (Some(a), None, _) => {
                let [x] = rounds(rk, [load(a)]);
                store(x, a);
            }
            (Some(a), Some(b), None) => {
                let [x, y] = rounds(rk, [load(a), load(b)]);
                store(x, a);
                store(y, b);
            }
            (Some(a), Some(b), Some(c)) => {
                let [x, y, z] = rounds(rk, [load(a), load(b), load(c)]);
                store(x, a);
                store(y, b);
                store(z, c);
            }
            (None, ..) => return,
        }
        tail.copy_from_slice(&pad[..tail.len()]);
        zeroize::Zeroize::zeroize(pad.as_flattened_mut());
    }

    /// For counter slot `s` of a group (the `s`-th block of sixteen), the 32-bit element of
    /// a transposed register that holds that block's word: [`transpose`] puts word j of
    /// block 4i + l at element 4l + i of register j. The map is its own inverse: element e
    /// holds slot `element(e)`.
    const fn element(s: usize) -> usize {
        4 * (s % 4) + s / 4
    }

    /// GCM's counter mode (NIST SP 800-38D §6.5, 96-bit nonce) on this kernel: XORs `data`
    /// with SM4 of the counter blocks `nonce ‖ 2`, `nonce ‖ 3`, …, and returns SM4 of
    /// `nonce ‖ 1` (the tag mask), computed in the last pass with the data's keystream.
    ///
    /// The counter blocks are made in the registers, already transposed (three of the four
    /// words are the nonce's), and the keystream never leaves them: each 64 bytes of data
    /// are loaded, XORed and stored with a byte mask, so a partial last block needs no
    /// padded copy and no keystream is left in memory to wipe.
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    pub fn ctr(rk: &[u32; 32], nonce: &[u8; 12], data: &mut [u8]) -> [u8; 16] {
        let counters = Counters::new(nonce);
        let mut start = 0;
        loop {
            let pass = Pass::at(data.len(), start);
            let mask = match pass.groups {
                1 => xor_pass::<1>(rk, &counters, data, &pass),
                2 => xor_pass::<2>(rk, &counters, data, &pass),
                _ => xor_pass::<3>(rk, &counters, data, &pass),
            };
            match mask {
                Some(mask) => return mask,
                None => start = pass.end,
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    fn xor_pass<const G: usize>(
        rk: &[u32; 32],
        counters: &Counters,
        data: &mut [u8],
        pass: &Pass,
    ) -> Option<[u8; 16]> {
        let keystream = keystream::<G>(rk, counters, pass);
        for (register, keystream) in keystream.as_flattened().iter().enumerate() {
            xor_at(data, pass.start * 16 + 64 * register, *keystream);
        }
        pass.mask(&keystream)
    }

    /// One pass of the counter mode: its data blocks and where the tag mask goes.
    pub struct Pass {
        /// The first data block.
        pub start: usize,
        /// The data block after the pass's last.
        pub end: usize,
        /// Where the tag mask's counter goes, counted from `start`: the slot after the
        /// last data block, in the last pass if it has room, else in a pass of its own.
        pub mask_slot: Option<usize>,
        /// Groups of sixteen slots: one, two or three.
        pub groups: usize,
    }

    impl Pass {
        /// The pass from data block `start` on, for `len` bytes of data.
        pub fn at(len: usize, start: usize) -> Pass {
            let blocks = len.div_ceil(16);
            let here = (blocks - start).min(WIDE);
            let mask_slot = (start + here == blocks && here < WIDE).then_some(here);
            let slots = here + usize::from(mask_slot.is_some());
            Pass {
                start,
                end: start + here,
                mask_slot,
                groups: slots.div_ceil(GROUP),
            }
        }

        /// The tag mask's keystream block, if this pass holds it.
        pub fn mask(&self, keystream: &[[__m512i; 4]]) -> Option<[u8; 16]> {
            let s = self.mask_slot?;
            let mut four = [0u8; 64];
            // SAFETY: an unaligned store of 64 bytes into a 64-byte array (AVX-512F, which
            // a `Pass` is only used with).
            unsafe {
                _mm512_storeu_si512(four.as_mut_ptr().cast(), keystream.as_flattened()[s / 4])
            };
            let mut block = [0u8; 16];
            block.copy_from_slice(&four[16 * (s % 4)..16 * (s % 4) + 16]);
            Some(block)
        }
    }

    /// The counter blocks' parts every pass shares.
    pub struct Counters {
        /// The nonce's three words, each in every element.
        fixed: [__m512i; 3],
        /// Element e: the offset of the slot it holds ([`element`]).
        lanes: __m512i,
    }

    impl Counters {
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub fn new(nonce: &[u8; 12]) -> Self {
            let word = |i: usize| {
                i32::from_be_bytes([
                    nonce[4 * i],
                    nonce[4 * i + 1],
                    nonce[4 * i + 2],
                    nonce[4 * i + 3],
                ])
            };
            Counters {
                fixed: [
                    _mm512_set1_epi32(word(0)),
                    _mm512_set1_epi32(word(1)),
                    _mm512_set1_epi32(word(2)),
                ],
                lanes: _mm512_setr_epi32(
                    element(0) as i32,
                    element(1) as i32,
                    element(2) as i32,
                    element(3) as i32,
                    element(4) as i32,
                    element(5) as i32,
                    element(6) as i32,
                    element(7) as i32,
                    element(8) as i32,
                    element(9) as i32,
                    element(10) as i32,
                    element(11) as i32,
                    element(12) as i32,
                    element(13) as i32,
                    element(14) as i32,
                    element(15) as i32,
                ),
            }
        }
    }

    /// A pass's keystream: `G` groups of sixteen counter slots from data block
    /// `pass.start` on (counter 2 + block), the tag mask's counter (1) in its slot; each
    /// register four blocks in data order, as they XOR onto 64 bytes of data.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    pub fn keystream<const G: usize>(
        rk: &[u32; 32],
        counters: &Counters,
        pass: &Pass,
    ) -> [[__m512i; 4]; G] {
        // Wrapping, as GCM's 32-bit increment.
        let first = 2u32.wrapping_add(pass.start as u32);
        let mut x = [[counters.lanes; 4]; G];
        for (g, x) in x.iter_mut().enumerate() {
            let base = _mm512_set1_epi32(first.wrapping_add(16 * g as u32) as i32);
            let mut numbers = _mm512_add_epi32(base, counters.lanes);
            if let Some(s) = pass.mask_slot.filter(|s| s / GROUP == g) {
                numbers =
                    _mm512_mask_mov_epi32(numbers, 1 << element(s % GROUP), _mm512_set1_epi32(1));
            }
            *x = [
                counters.fixed[0],
                counters.fixed[1],
                counters.fixed[2],
                numbers,
            ];
        }
        let mut x = rounds(rk, x);
        for x in x.iter_mut() {
            *x = transpose([x[3], x[2], x[1], x[0]]).map(|r| swap(r));
        }
        x
    }

    /// XORs `keystream` onto the 64 bytes of `data` from byte `at` (fewer at its end;
    /// nothing past it): (the bytes before, the bytes after), zero past `data`'s end.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub fn xor_at(data: &mut [u8], at: usize, keystream: __m512i) -> (__m512i, __m512i) {
        if at >= data.len() {
            let zero = _mm512_setzero_si512();
            return (zero, zero);
        }
        let n = (data.len() - at).min(64);
        let bytes = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        // SAFETY: `at` is inside `data`, and the masked load and store touch only its `n`
        // bytes from there (the others are masked off).
        unsafe {
            let p = data.as_mut_ptr().add(at);
            let text = _mm512_maskz_loadu_epi8(bytes, p.cast());
            let out = _mm512_maskz_mov_epi8(bytes, _mm512_xor_si512(text, keystream));
            _mm512_mask_storeu_epi8(p.cast(), bytes, out);
            (text, out)
        }
    }
}
