//! The model's output sigmoid on eight values at once, bit for bit [`crate::artifact::sigmoid`].
//!
//! An explanation takes 8,448 sigmoids, each through `libm::expf` (FreeBSD's `e_expf.c`
//! in single precision), one at a time. Every step of that `expf` on its main path is a
//! plain IEEE single-precision operation (no fused multiply-add: Rust never contracts), so
//! the same operations in the eight lanes of an AVX2 register give the same bits. Lanes
//! off the main path (|x| ≤ 2⁻¹⁴, |x| ≥ 80, NaN: where `expf` takes other branches or its
//! `scalbnf` would scale into subnormals in steps) send the whole vector to the scalar
//! function. A test compares the two over millions of inputs.

use crate::artifact::sigmoid;

/// `sigmoid` of each of the eight values.
pub fn sigmoid8(z: [f32; 8]) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        if let Some(p) = unsafe { avx2::sigmoid8(z) } {
            return p;
        }
    }
    z.map(sigmoid)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    // `libm`'s expf constants, by bits.
    const LN2_HI: u32 = 0x3f31_7200;
    const LN2_LO: u32 = 0x35bf_be8e;
    const INV_LN2: u32 = 0x3fb8_aa3b;
    const P1: u32 = 0x3e2a_aa8f;
    const P2: u32 = 0xbb35_5215;
    /// |x| above 0.5·ln 2 and above 1.5·ln 2: where `expf` picks k.
    const HALF_LN2: i32 = 0x3eb1_7218;
    const THREE_HALVES_LN2: i32 = 0x3f85_1592;
    /// The main path's bounds on |x| (exclusive): 2⁻¹⁴ and 80.
    const TINY: i32 = 0x3900_0000;
    const LARGE: i32 = 0x42a0_0000;

    /// 1 / (1 + expf(−z)) per lane, or `None` when a lane is off the main path.
    #[target_feature(enable = "avx2")]
    pub(super) fn sigmoid8(z: [f32; 8]) -> Option<[f32; 8]> {
        // SAFETY: an unaligned load of 8 floats from an array of 8.
        let z = unsafe { _mm256_loadu_ps(z.as_ptr()) };
        let x = _mm256_xor_ps(z, _mm256_set1_ps(-0.0));
        let bits = _mm256_castps_si256(x);
        let hx = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fff_ffff));
        // Signed compares are right: hx has no sign bit, NaN's hx is above LARGE.
        let inside = _mm256_and_si256(
            _mm256_cmpgt_epi32(hx, _mm256_set1_epi32(TINY)),
            _mm256_cmpgt_epi32(_mm256_set1_epi32(LARGE), hx),
        );
        if _mm256_movemask_epi8(inside) != -1 {
            return None;
        }
        let negative = _mm256_srai_epi32(bits, 31);
        // |x| > 1.5 ln 2: k = (int)(INV_LN2 · x + ±0.5), the product rounded first.
        let half = _mm256_blendv_ps(
            _mm256_set1_ps(0.5),
            _mm256_set1_ps(-0.5),
            _mm256_castsi256_ps(negative),
        );
        let far = _mm256_cvttps_epi32(_mm256_add_ps(
            _mm256_mul_ps(_mm256_castsi256_ps(_mm256_set1_epi32(INV_LN2 as i32)), x),
            half,
        ));
        // 0.5 ln 2 < |x| ≤ 1.5 ln 2: k = 1 − 2·sign; below: k = 0 (then hi = x − 0 = x and
        // lo = 0 · LN2_LO = 0, as `expf`'s own k = 0 branch has them).
        let near = _mm256_or_si256(negative, _mm256_set1_epi32(1));
        let k = _mm256_blendv_epi8(
            _mm256_and_si256(near, _mm256_cmpgt_epi32(hx, _mm256_set1_epi32(HALF_LN2))),
            far,
            _mm256_cmpgt_epi32(hx, _mm256_set1_epi32(THREE_HALVES_LN2)),
        );
        let kf = _mm256_cvtepi32_ps(k);
        let hi = _mm256_sub_ps(
            x,
            _mm256_mul_ps(kf, _mm256_castsi256_ps(_mm256_set1_epi32(LN2_HI as i32))),
        );
        let lo = _mm256_mul_ps(kf, _mm256_castsi256_ps(_mm256_set1_epi32(LN2_LO as i32)));
        let x = _mm256_sub_ps(hi, lo);
        // c = x − xx·(P1 + xx·P2); y = 1 + (x·c / (2 − c) − lo + hi)
        let xx = _mm256_mul_ps(x, x);
        let c = _mm256_sub_ps(
            x,
            _mm256_mul_ps(
                xx,
                _mm256_add_ps(
                    _mm256_castsi256_ps(_mm256_set1_epi32(P1 as i32)),
                    _mm256_mul_ps(xx, _mm256_castsi256_ps(_mm256_set1_epi32(P2 as i32))),
                ),
            ),
        );
        let ratio = _mm256_div_ps(_mm256_mul_ps(x, c), _mm256_sub_ps(_mm256_set1_ps(2.0), c));
        let y = _mm256_add_ps(
            _mm256_set1_ps(1.0),
            _mm256_add_ps(_mm256_sub_ps(ratio, lo), hi),
        );
        // scalbnf(y, k) for |k| ≤ 116: one exact multiplication by 2^k.
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(k, _mm256_set1_epi32(127)),
            23,
        ));
        let e = _mm256_mul_ps(y, scale);
        let p = _mm256_div_ps(_mm256_set1_ps(1.0), _mm256_add_ps(_mm256_set1_ps(1.0), e));
        let mut out = [0f32; 8];
        // SAFETY: an unaligned store of 8 floats into an array of 8.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), p) };
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every 4,099th bit pattern of f32 (both signs, NaN and infinities included), eight at
    /// a time with neighbours of both paths mixed, against the scalar sigmoid.
    #[test]
    fn eight_lanes_are_the_scalar_sigmoid_bit_for_bit() {
        let mut checked = 0u64;
        let mut bits: u64 = 0;
        while bits < (1u64 << 32) {
            let z: [f32; 8] =
                std::array::from_fn(|i| f32::from_bits((bits + i as u64 * 613) as u32));
            let got = sigmoid8(z);
            for (g, z) in got.iter().zip(z) {
                let want = sigmoid(z);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "sigmoid({z:e}) = {g:e} in the lanes, {want:e} alone"
                );
            }
            checked += 8;
            bits += 4_099 * 8;
        }
        assert!(checked > 1_000_000);
    }

    /// The values an explanation meets (scores' logits, −20 … 20), densely.
    #[test]
    fn logits_of_every_size_match() {
        let mut z = -20.0f32;
        while z < 20.0 {
            let lanes: [f32; 8] = std::array::from_fn(|i| z + i as f32 * 1e-3);
            for (g, z) in sigmoid8(lanes).iter().zip(lanes) {
                assert_eq!(g.to_bits(), sigmoid(z).to_bits(), "at {z:e}");
            }
            z += 0.0071;
        }
    }
}
