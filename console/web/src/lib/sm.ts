// The SM3/SM2 primitives verify.ts needs, from sm-crypto-v2 (pure JS on @noble/curves).
// The page imports this module dynamically, so the crypto is not in the initial load.
import { sm2, sm3 } from 'sm-crypto-v2';
import { hexToBytes, type Sm } from './verify.ts';

export const sm: Sm = {
  sm3: (data) => hexToBytes(sm3(data)),
  // hash: true makes the library compute Z_A‖M with the user id, as GB/T 32918 asks.
  sm2Verify: (message, sig, key) =>
    sm2.doVerifySignature(message, sig, key, { hash: true, userId: '1234567812345678' }),
};
