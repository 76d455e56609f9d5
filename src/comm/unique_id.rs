//! The NCCL unique id: 128 opaque bytes that rank 0 creates and every rank must receive
//! before it can join a communicator.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The size of NCCL's `ncclUniqueId` in bytes (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// The bytes of an NCCL `ncclUniqueId`.
///
/// Rank 0 creates one; every rank of the communicator must be given the same bytes
/// (see [`bootstrap`](crate::comm::bootstrap)). In text it is written as 256 lowercase hex
/// digits ([`Display`](fmt::Display), [`FromStr`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId(pub(crate) [u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// Takes the id from exactly [`UNIQUE_ID_BYTES`] bytes.
    ///
    /// Any other length is [`Error::MalformedUniqueId`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let array: [u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            Error::MalformedUniqueId(format!("{} bytes, expected {UNIQUE_ID_BYTES}", bytes.len()))
        })?;
        Ok(UniqueId(array))
    }

    /// The raw bytes, as NCCL wants them.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }

    /// The id as 256 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = String::with_capacity(2 * UNIQUE_ID_BYTES);
        for byte in self.0 {
            hex.push(char::from(DIGITS[usize::from(byte >> 4)]));
            hex.push(char::from(DIGITS[usize::from(byte & 0xf)]));
        }
        hex
    }

    /// Parses 256 hex digits (either case); surrounding whitespace is ignored.
    ///
    /// A wrong length or a character that is not a hex digit is
    /// [`Error::MalformedUniqueId`] naming the length or the character and its position.
    pub fn from_hex(text: &str) -> Result<Self> {
        let text = text.trim();
        let digits = text.chars().count();
        if digits != 2 * UNIQUE_ID_BYTES {
            return Err(Error::MalformedUniqueId(format!(
                "{digits} hex digits, expected {}",
                2 * UNIQUE_ID_BYTES
            )));
        }
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (position, c) in text.chars().enumerate() {
            let nibble = c.to_digit(16).ok_or_else(|| {
                Error::MalformedUniqueId(format!("{c:?} at position {position} is not a hex digit"))
            })?;
            // to_digit(16) is below 16, so this fits in a u8.
            bytes[position / 2] |= (nibble as u8) << if position % 2 == 0 { 4 } else { 0 };
        }
        Ok(UniqueId(bytes))
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    /// Same as [`UniqueId::from_hex`].
    fn from_str(text: &str) -> Result<Self> {
        UniqueId::from_hex(text)
    }
}

impl fmt::Display for UniqueId {
    /// The 256 lowercase hex digits of [`UniqueId::to_hex`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for UniqueId {
    /// A short form with the first four bytes, e.g. `UniqueId(0123abcd…)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, ..] = self.0;
        write!(f, "UniqueId({a:02x}{b:02x}{c:02x}{d:02x}…)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_is_short() {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        bytes[..4].copy_from_slice(&[0x01, 0x23, 0xab, 0xcd]);
        assert_eq!(format!("{:?}", UniqueId(bytes)), "UniqueId(0123abcd…)");
    }
}
