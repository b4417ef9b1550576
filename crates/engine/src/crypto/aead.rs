//! AES-256-GCM-SIV (RFC 8452), the AEAD of fragments and key slots, from AWS-LC
//! (`aws-lc-rs`): its assembly dispatches on the CPU at run time, so a portable build seals
//! a 2 KiB fragment in 0.6 µs where RustCrypto's `aes-gcm-siv` takes 0.96 µs (that crate's
//! speed needs a build for the CPU it runs on; `docs/format.md`, "Why AWS-LC"). The bytes
//! are RFC 8452's either way: stores sealed by the RustCrypto crate open unchanged, and a
//! test checks the two against each other.
//!
//! The key schedule lives in AWS-LC's allocation, which AWS-LC cleanses when it frees it
//! (`OPENSSL_free`); unlike the raw keys it is not locked in memory (`docs/guarantees.md`).

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM_SIV};

use super::KEY_BYTES;

pub const NONCE_BYTES: usize = 12;
pub const TAG_BYTES: usize = 16;

/// An AES-256-GCM-SIV key. `LessSafeKey` because the caller chooses each nonce: fragments
/// take a durable counter's next value (`cipher::NonceSource`), key slots a random one.
pub(crate) struct Aead(LessSafeKey);

/// Opening failed: the tag does not match the nonce, associated data and ciphertext.
#[derive(Debug)]
pub(crate) struct Unauthentic;

impl Aead {
    pub fn new(key: &[u8; KEY_BYTES]) -> Aead {
        Aead(LessSafeKey::new(UnboundKey::new(&AES_256_GCM_SIV, key).expect("a 32-byte key")))
    }

    /// Encrypts `in_out` in place; returns the tag.
    pub fn seal(&self, nonce: [u8; NONCE_BYTES], aad: &[u8], in_out: &mut [u8]) -> [u8; TAG_BYTES] {
        let tag = self
            .0
            .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), in_out)
            .expect("AES-GCM-SIV seals messages up to 2^36 bytes");
        tag.as_ref().try_into().expect("a 16-byte tag")
    }

    /// Decrypts `in_out` in place if `tag` authenticates it; on failure `in_out` holds
    /// unspecified bytes.
    pub fn open(&self, nonce: [u8; NONCE_BYTES], aad: &[u8], in_out: &mut [u8], tag: &[u8]) -> Result<(), Unauthentic> {
        self.0
            .open_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), tag, in_out)
            .map(|_| ())
            .map_err(|_| Unauthentic)
    }
}

#[cfg(test)]
mod tests {
    use aes_gcm_siv::aead::{AeadInOut, KeyInit};
    use rand::{Rng, SeedableRng};

    use super::*;

    /// AWS-LC and RustCrypto (which sealed every store before 2026-11-26) make the same
    /// bytes and open each other's, for every length a fragment or key slot has and more.
    #[test]
    fn seals_the_same_bytes_as_rustcrypto_and_opens_them() {
        let seed: u64 = rand::random();
        println!("seed {seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for len in (0..=64).chain([1000, 2048, 4095, 4096, 4097]) {
            let key: [u8; KEY_BYTES] = rng.gen();
            let nonce: [u8; NONCE_BYTES] = rng.gen();
            let aad: Vec<u8> = (0..rng.gen_range(0..40)).map(|_| rng.gen()).collect();
            let plain: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let ours = Aead::new(&key);
            let theirs = aes_gcm_siv::Aes256GcmSiv::new_from_slice(&key).unwrap();
            let mut sealed = plain.clone();
            let tag = ours.seal(nonce, &aad, &mut sealed);
            let mut expected = plain.clone();
            let expected_tag =
                theirs.encrypt_inout_detached(&nonce.into(), &aad, expected.as_mut_slice().into()).unwrap();
            assert_eq!((&sealed, &tag[..]), (&expected, &expected_tag[..]), "length {len}");
            let mut opened = sealed.clone();
            ours.open(nonce, &aad, &mut opened, &tag).unwrap();
            assert_eq!(opened, plain);
            // Any changed bit of ciphertext, tag, nonce or associated data fails.
            if len > 0 {
                let mut tampered = sealed.clone();
                tampered[rng.gen_range(0..len)] ^= 1 << rng.gen_range(0..8);
                assert!(ours.open(nonce, &aad, &mut tampered, &tag).is_err());
            }
            let mut bad_tag = tag;
            bad_tag[rng.gen_range(0..TAG_BYTES)] ^= 1;
            assert!(ours.open(nonce, &aad, &mut sealed.clone(), &bad_tag).is_err());
            let mut bad_nonce = nonce;
            bad_nonce[0] ^= 0x80;
            assert!(ours.open(bad_nonce, &aad, &mut sealed.clone(), &tag).is_err());
            let mut bad_aad = aad.clone();
            bad_aad.push(0);
            assert!(ours.open(nonce, &bad_aad, &mut sealed.clone(), &tag).is_err());
        }
    }
}
