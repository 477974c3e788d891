//! Sizes as people type them, one grammar for every Strata command: a decimal number, then
//! an optional binary unit (`K`, `M`, `G`, `T`, `P`, each also with `B` or `iB`, any case;
//! `GB` means GiB, as qemu-img reads it). `4096`, `512K`, `1.5G`, `16TiB`, ` 8 G `.
//!
//! The arithmetic is exact (integers, never floating point), so a size is either exactly the
//! bytes typed or refused. A fraction that does not come to whole bytes (`1.1G`) is refused
//! by [`parse_size`] and rounded to the nearest byte by [`parse_size_rounded`]; the grammar
//! is the same for both. Range checks (a block size's bounds, a `u32`) are the caller's.
//!
//! Must not depend on anything else in the workspace: the daemon, `strata size` and
//! `strata bench` all use it.

/// Why a size was refused. The message names the text and fits on one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("invalid size {0:?}: expected a number with an optional unit such as 512K, 64M, 1G")]
    Syntax(String),
    #[error("invalid size {text:?}: unknown unit {unit:?} (use K, M, G, T or P)")]
    UnknownUnit { text: String, unit: String },
    #[error("invalid size {0:?}: too many decimals")]
    TooManyDecimals(String),
    #[error("invalid size {0:?}: not a whole number of bytes (use a smaller unit)")]
    NotWholeBytes(String),
    #[error("invalid size {0:?}: too large")]
    TooLarge(String),
}

/// At most this many decimals: 10^18 times 2^50 (a petabyte's shift) still fits a u128.
const DECIMALS_MAX: usize = 18;

/// The size `text` names, in bytes; a fraction must come to whole bytes (`1.5G` does, `1.1G`
/// does not).
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    parse(text, Fraction::Exact)
}

/// The size `text` names, rounded to the nearest byte (halves up): `1.3T` is
/// 1,429,365,116,109 bytes. For estimates, where refusing a round figure helps nobody.
pub fn parse_size_rounded(text: &str) -> Result<u64, SizeError> {
    parse(text, Fraction::Round)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Fraction {
    Exact,
    Round,
}

fn parse(text: &str, fraction_rule: Fraction) -> Result<u64, SizeError> {
    let s = text.trim();
    let number_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let number = &s[..number_end];
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || fraction.contains('.') || number.ends_with('.') {
        return Err(SizeError::Syntax(text.into()));
    }
    let unit = s[number_end..].trim();
    let shift = unit_shift(unit).ok_or_else(|| SizeError::UnknownUnit {
        text: text.into(),
        unit: unit.into(),
    })?;
    let too_large = || SizeError::TooLarge(text.into());
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    let mut bytes = whole.checked_mul(1 << shift).ok_or_else(too_large)?;
    // Trailing zeros add nothing: only the decimals that do count against the limit.
    let fraction = fraction.trim_end_matches('0');
    if !fraction.is_empty() {
        if fraction.len() > DECIMALS_MAX {
            return Err(SizeError::TooManyDecimals(text.into()));
        }
        let digits: u128 = fraction.parse().map_err(|_| too_large())?;
        let scaled = digits << shift;
        let ten_pow = 10u128.pow(fraction.len() as u32);
        let part = match fraction_rule {
            Fraction::Exact if !scaled.is_multiple_of(ten_pow) => {
                return Err(SizeError::NotWholeBytes(text.into()))
            }
            Fraction::Exact => scaled / ten_pow,
            Fraction::Round => (scaled + ten_pow / 2) / ten_pow,
        };
        bytes = bytes.checked_add(part).ok_or_else(too_large)?;
    }
    u64::try_from(bytes).map_err(|_| too_large())
}

/// log2 of the unit's bytes; None for an unknown unit.
fn unit_shift(unit: &str) -> Option<u32> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_binary_in_any_spelling() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("7B"), Ok(7));
        assert_eq!(parse_size("512K"), Ok(512 << 10));
        assert_eq!(parse_size("32kib"), Ok(32 << 10));
        assert_eq!(parse_size("64MB"), Ok(64 << 20));
        assert_eq!(parse_size("1gb"), Ok(1 << 30));
        assert_eq!(parse_size("16TiB"), Ok(16 << 40));
        assert_eq!(parse_size("2P"), Ok(2 << 50));
        assert_eq!(parse_size(" 8 G "), Ok(8 << 30));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("0.25M"), Ok(256 << 10));
        assert_eq!(parse_size("15.0009765625P"), Ok((15 << 50) + (1 << 40)));
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn bad_sizes_say_why_on_one_line() {
        for bad in [
            "", "G", "abc", "-1", "+1", ".5G", "1.G", "1.2.3M", "1e3", "1 G B",
        ] {
            let e = parse_size(bad).unwrap_err();
            assert!(
                matches!(e, SizeError::Syntax(_) | SizeError::UnknownUnit { .. }),
                "{bad}: {e}"
            );
            assert!(e.to_string().starts_with("invalid size"), "{bad}: {e}");
        }
        let e = parse_size("12Q").unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid size \"12Q\": unknown unit \"Q\" (use K, M, G, T or P)"
        );
        assert_eq!(parse_size("1.0000000000000000000000"), Ok(1));
        assert_eq!(parse_size("1.50000000000000000000K"), Ok(1536));
        assert!(matches!(
            parse_size("0.0000000000000000001K"),
            Err(SizeError::TooManyDecimals(_))
        ));
    }

    #[test]
    fn sizes_past_u64_are_too_large_not_wrapped() {
        for big in [
            "18446744073709551616",
            "16384P",
            "99999999999999999999999999999999999999999",
            // 2^78 PiB is 2^128 bytes: a shift that drops the high bits would make it 0.
            "302231454903657293676544P",
        ] {
            assert_eq!(parse_size(big), Err(SizeError::TooLarge(big.into())));
            assert_eq!(
                parse_size_rounded(big),
                Err(SizeError::TooLarge(big.into()))
            );
        }
        // Rounding up past the largest value is too large as well.
        for big in [
            "18446744073709551615.5",
            "340282366920938463463374607431768211455.5",
        ] {
            assert_eq!(
                parse_size_rounded(big),
                Err(SizeError::TooLarge(big.into()))
            );
        }
    }

    #[test]
    fn a_fraction_of_a_byte_is_refused_or_rounded() {
        for (text, rounded) in [
            ("1.1", 1),
            ("1.5", 2),
            ("1.1G", 1_181_116_006),
            ("1.3T", 1_429_365_116_109),
            ("0.001K", 1),
            ("0.0001K", 0),
        ] {
            assert_eq!(parse_size(text), Err(SizeError::NotWholeBytes(text.into())));
            assert!(parse_size(text)
                .unwrap_err()
                .to_string()
                .contains("use a smaller unit"));
            assert_eq!(parse_size_rounded(text), Ok(rounded), "{text}");
        }
        // The grammar is the same: what one refuses as text, the other refuses too.
        for bad in [".5G", "1.G", "12Q", "1.5 G B"] {
            assert_eq!(parse_size_rounded(bad), parse_size(bad), "{bad}");
        }
        assert_eq!(parse_size_rounded("1.5G"), Ok(3 << 29));
    }
}
