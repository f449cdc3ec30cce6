//! SM4-GCM in one pass over the message where the CPU has GFNI and VPCLMULQDQ: GHASH takes
//! the ciphertext from the counter mode's registers (the ciphertext it writes when sealing,
//! the one it reads when opening) instead of reading the message a second time.
//!
//! For messages whose associated data, ciphertext and lengths block fit one GHASH window
//! (up to ~1 KiB: a clearing request's record or envelope); longer ones go through the
//! counter mode and GHASH one after the other ([`crate::aead::Sm4Gcm`]).

use crate::ghash512::{Powers, Window};
use crate::sm4ct::gfni::{Counters, Pass, keystream, xor_at};

/// Encrypts (`seal`) or decrypts `data` in place under `nonce`; GHASH_H(aad, ciphertext)
/// XOR the tag mask, i.e. the tag. `None`, with `data` untouched, if the message does not
/// fit one GHASH window.
///
/// Only where the CPU has AVX-512F/BW, GFNI, VPCLMULQDQ and PCLMULQDQ, as round keys for
/// the GFNI kernel and a [`Powers`] do.
#[target_feature(enable = "avx512f,avx512bw,gfni,vpclmulqdq,pclmulqdq")]
pub fn crypt(
    rk: &[u32; 32],
    powers: &Powers,
    nonce: &[u8; 12],
    aad: &[u8],
    data: &mut [u8],
    seal: bool,
) -> Option<[u8; 16]> {
    let mut window = powers.window(aad, data.len())?;
    let counters = Counters::new(nonce);
    let mut start = 0;
    loop {
        let pass = Pass::at(data.len(), start);
        let mask = match pass.groups {
            1 => hashed_pass::<1>(rk, &counters, data, &pass, &mut window, seal),
            2 => hashed_pass::<2>(rk, &counters, data, &pass, &mut window, seal),
            _ => hashed_pass::<3>(rk, &counters, data, &pass, &mut window, seal),
        };
        if let Some(mask) = mask {
            let hash = window.finish();
            return Some(std::array::from_fn(|i| hash[i] ^ mask[i]));
        }
        start = pass.end;
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,gfni,vpclmulqdq,pclmulqdq")]
fn hashed_pass<const G: usize>(
    rk: &[u32; 32],
    counters: &Counters,
    data: &mut [u8],
    pass: &Pass,
    window: &mut Window<'_>,
    seal: bool,
) -> Option<[u8; 16]> {
    let keystream = keystream::<G>(rk, counters, pass);
    // A pass starts on a multiple of 48 blocks: a whole number of registers.
    let first = pass.start / 4;
    for (register, keystream) in keystream.as_flattened().iter().enumerate() {
        let at = pass.start * 16 + 64 * register;
        if at >= data.len() {
            break;
        }
        let (before, after) = xor_at(data, at, *keystream);
        window.add(first + register, if seal { after } else { before });
    }
    pass.mask(&keystream)
}
