//! `cargo bench -p zdisk-engine --bench crypto`: what encryption costs per fragment and per
//! record on this CPU, with the primitives an encrypted store uses (`docs/format.md`,
//! "Encryption"): AES-256-GCM-SIV seal and open of a fragment (2 KiB: a 2:1 block; 4 KiB: a
//! raw one) with AWS-LC (the store's) and RustCrypto (the store's before 2026-11-26), the
//! placement tag (one AES block, or two binding the segment's use), and the HMAC-SHA-256 of
//! a record's head and entries (a batch of 32 entries).
//! Also AES-256-GCM for comparison (the nonce-misuse-resistant choice's price). Numbers, not
//! assertions: compare them with a request's CPU budget (`scripts/compare.sh` IOPS / cores).

use std::time::Instant;

use aes_gcm_siv::aead::{AeadInOut, KeyInit};
use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, AES_256_GCM_SIV};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use zdisk_engine::crypto::cipher::StoreCipher;
use zdisk_engine::crypto::DataKey;

const ROUNDS: usize = 50_000;

fn per_op(what: &str, bytes: usize, mut op: impl FnMut()) {
    for _ in 0..ROUNDS / 10 {
        op();
    }
    let started = Instant::now();
    for _ in 0..ROUNDS {
        op();
    }
    let ns = started.elapsed().as_nanos() as f64 / ROUNDS as f64;
    println!("{what:<44} {bytes:>6} B  {ns:>8.0} ns/op  {:>6.2} GB/s", bytes as f64 / ns);
}

/// The next counter nonce, as the store forms it: 32 zero bits, then the counter.
fn next_nonce(counter: &mut u64) -> [u8; 12] {
    *counter += 1;
    let mut nonce = [0u8; 12];
    nonce[4..].copy_from_slice(&counter.to_le_bytes());
    nonce
}

fn main() {
    let key = [7u8; 32];
    let siv = aes_gcm_siv::Aes256GcmSiv::new_from_slice(&key).unwrap();
    let gcm = aes_gcm::Aes256Gcm::new_from_slice(&key).unwrap();
    let aws_siv = LessSafeKey::new(UnboundKey::new(&AES_256_GCM_SIV, &key).unwrap());
    let aws_gcm = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &key).unwrap());
    let aad = [1u8; 27];
    for bytes in [2048usize, 4096] {
        let mut buf = vec![0x5au8; bytes];
        let mut nonce = 0u64;
        per_op("AES-256-GCM-SIV seal, AWS-LC (the store's)", bytes, || {
            let n = Nonce::assume_unique_for_key(next_nonce(&mut nonce));
            let tag = aws_siv.seal_in_place_separate_tag(n, Aad::from(&aad), &mut buf).unwrap();
            std::hint::black_box(tag.as_ref()[0]);
        });
        let n = [3u8; 12];
        let mut sealed = vec![0x5au8; bytes];
        let tag =
            aws_siv.seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::from(&aad), &mut sealed).unwrap();
        per_op("AES-256-GCM-SIV open, AWS-LC (with a read's copy)", bytes, || {
            let mut plain = sealed.clone();
            let n = Nonce::assume_unique_for_key(n);
            aws_siv.open_in_place_separate_tag(n, Aad::from(&aad), tag.as_ref(), &mut plain).unwrap();
            std::hint::black_box(plain);
        });
        per_op("AES-256-GCM-SIV seal, RustCrypto", bytes, || {
            let n = next_nonce(&mut nonce);
            let tag = siv.encrypt_inout_detached(&n.into(), &aad, buf.as_mut_slice().into()).unwrap();
            std::hint::black_box(tag);
        });
        let tag = siv.encrypt_inout_detached(&n.into(), &aad, sealed.as_mut_slice().into()).unwrap();
        per_op("AES-256-GCM-SIV open, RustCrypto (with a copy)", bytes, || {
            let mut plain = sealed.clone();
            siv.decrypt_inout_detached(&n.into(), &aad, plain.as_mut_slice().into(), &tag).unwrap();
            std::hint::black_box(plain);
        });
        per_op("AES-256-GCM seal, AWS-LC (comparison)", bytes, || {
            let n = Nonce::assume_unique_for_key(next_nonce(&mut nonce));
            let tag = aws_gcm.seal_in_place_separate_tag(n, Aad::from(&aad), &mut buf).unwrap();
            std::hint::black_box(tag.as_ref()[0]);
        });
        per_op("AES-256-GCM seal, RustCrypto (comparison)", bytes, || {
            let n = next_nonce(&mut nonce);
            let tag = gcm.encrypt_inout_detached(&n.into(), &aad, buf.as_mut_slice().into()).unwrap();
            std::hint::black_box(tag);
        });
    }
    // The placement tag (`StoreCipher::placement`): one AES-256 block of address and tag,
    // and since stores bind the segment's use, a second.
    let placement = <aes::Aes256 as aes::cipher::KeyInit>::new_from_slice(&key).unwrap();
    for blocks in [1usize, 2] {
        let name = if blocks == 1 {
            "placement tag, address only (1 AES block)"
        } else {
            "placement tag with the use (2 AES blocks)"
        };
        let mut use_seq = 0u64;
        per_op(name, 16, || {
            let mut block = aes::Block::default();
            block[..8].copy_from_slice(&use_seq.to_le_bytes());
            for _ in 0..blocks {
                aes::cipher::BlockCipherEncrypt::encrypt_block(&placement, &mut block);
            }
            use_seq += 1;
            std::hint::black_box(block);
        });
    }
    // The store's own function, as the log calls it for every fragment.
    let store_cipher = StoreCipher::new([5u8; 16], &DataKey::from_bytes(key), None);
    let sealed = vec![0x33u8; 2048 + 24];
    let mut use_seq = 0u64;
    per_op("StoreCipher::placement (the use bound: 2 AES blocks)", 16, || {
        use_seq += 1;
        std::hint::black_box(store_cipher.placement(use_seq * 4096, use_seq, &sealed));
    });
    let record = vec![9u8; 64 + 32 * 8];
    per_op("HMAC-SHA-256 of a record (keyed each time)", record.len(), || {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&key).unwrap();
        mac.update(&record);
        std::hint::black_box(mac.finalize().into_bytes());
    });
    let keyed = <Hmac<Sha256> as Mac>::new_from_slice(&key).unwrap();
    per_op("HMAC-SHA-256 of a record (pre-keyed clone)", record.len(), || {
        let mut mac = keyed.clone();
        mac.update(&record);
        std::hint::black_box(mac.finalize().into_bytes());
    });
}
