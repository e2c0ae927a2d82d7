//! A small lexer for the code corpus: enough to tell identifiers, numbers,
//! strings, comments and punctuation apart, with byte spans, in the five
//! language families. It is not a parser; the edit archetypes read its
//! tokens with lexical rules (documented on each archetype).

use super::Language;

/// What a lexical token is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `[A-Za-z_$][A-Za-z0-9_$]*` (`$` only in JavaScript/TypeScript).
    Ident,
    /// A numeric literal (`12`, `0x1F`, `3.5`, `1e-3`, `10u32`).
    Number,
    /// A string, character or template literal (prefixes such as `f`, `b`,
    /// `r` included).
    Str,
    /// A comment (line or block).
    Comment,
    /// An operator or punctuation (longest match among the multi-character
    /// operators).
    Punct,
}

/// One lexical token: its kind and byte span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tok {
    pub kind: Kind,
    pub start: usize,
    pub end: usize,
}

/// A lexed source: tokens (comments included), and line starts.
#[derive(Debug, Clone)]
pub(crate) struct Lexed<'a> {
    pub src: &'a str,
    pub toks: Vec<Tok>,
    /// Byte offset where each line starts.
    pub line_starts: Vec<usize>,
}

const OPS3: &[&str] = &[">>=", "<<=", "**=", "...", "===", "!==", "//="];
const OPS2: &[&str] = &[
    "::", "->", "=>", "==", "!=", "<=", ">=", "&&", "||", "+=", "-=", "*=", "/=", "%=", "++", "--",
    "<<", ">>", "**", ":=", "|=", "&=", "^=", "?.", "??", "..", "//",
];

impl<'a> Lexed<'a> {
    /// Lexes `src` with the rules of `lang`.
    pub fn new(src: &'a str, lang: Language) -> Self {
        let b = src.as_bytes();
        let n = b.len();
        let mut toks = Vec::new();
        let mut i = 0;
        let line_comment: &[u8] = if lang == Language::Python {
            b"#"
        } else {
            b"//"
        };
        while i < n {
            let c = b[i];
            if c.is_ascii_whitespace() {
                i += 1;
                continue;
            }
            let start = i;
            // Comments.
            if b[i..].starts_with(line_comment) {
                while i < n && b[i] != b'\n' {
                    i += 1;
                }
                toks.push(Tok {
                    kind: Kind::Comment,
                    start,
                    end: i,
                });
                continue;
            }
            if lang != Language::Python && b[i..].starts_with(b"/*") {
                i += 2;
                while i < n && !b[i..].starts_with(b"*/") {
                    i += 1;
                }
                i = (i + 2).min(n);
                toks.push(Tok {
                    kind: Kind::Comment,
                    start,
                    end: i,
                });
                continue;
            }
            // Identifiers, and string prefixes glued to a quote.
            if c.is_ascii_alphabetic() || c == b'_' || (c == b'$' && lang.is_js()) {
                while i < n
                    && (b[i].is_ascii_alphanumeric()
                        || b[i] == b'_'
                        || (b[i] == b'$' && lang.is_js()))
                {
                    i += 1;
                }
                let word = &src[start..i];
                if i < n
                    && (b[i] == b'"' || b[i] == b'\'')
                    && word.len() <= 2
                    && word.bytes().all(|x| b"rbfuRBFUL8".contains(&x))
                    && !(lang == Language::Rust && b[i] == b'\'' && word != "b")
                {
                    i = scan_string(b, i, lang);
                    toks.push(Tok {
                        kind: Kind::Str,
                        start,
                        end: i,
                    });
                } else {
                    toks.push(Tok {
                        kind: Kind::Ident,
                        start,
                        end: i,
                    });
                }
                continue;
            }
            if c.is_ascii_digit() {
                i = scan_number(b, i);
                toks.push(Tok {
                    kind: Kind::Number,
                    start,
                    end: i,
                });
                continue;
            }
            if c == b'"'
                || c == b'`'
                || (c == b'\'' && !(lang == Language::Rust && is_lifetime(b, i)))
            {
                i = scan_string(b, i, lang);
                toks.push(Tok {
                    kind: Kind::Str,
                    start,
                    end: i,
                });
                continue;
            }
            let rest = &src[i..];
            let op = OPS3.iter().chain(OPS2).find(|op| {
                rest.starts_with(**op)
                    && (**op != "//" && **op != "//=" || lang == Language::Python)
            });
            let len = op.map_or_else(
                || rest.chars().next().map_or(1, char::len_utf8),
                |op| op.len(),
            );
            i += len;
            toks.push(Tok {
                kind: Kind::Punct,
                start,
                end: i,
            });
        }
        let mut line_starts = vec![0];
        line_starts.extend(src.match_indices('\n').map(|(k, _)| k + 1));
        Self {
            src,
            toks,
            line_starts,
        }
    }

    /// The text of token `k`.
    #[cfg(test)]
    pub fn text(&self, k: usize) -> &'a str {
        &self.src[self.toks[k].start..self.toks[k].end]
    }

    /// The 0-based line of a byte offset.
    pub fn line_of(&self, offset: usize) -> usize {
        self.line_starts.partition_point(|&s| s <= offset) - 1
    }

    /// The byte span of line `l` without its newline.
    pub fn line_span(&self, l: usize) -> (usize, usize) {
        let s = self.line_starts[l];
        let e = self
            .line_starts
            .get(l + 1)
            .map_or(self.src.len(), |&x| x - 1);
        (s, e)
    }
}

fn is_lifetime(b: &[u8], i: usize) -> bool {
    // `'a` (lifetime or label) against `'a'`, `'\n'` (char literals).
    let n = b.len();
    if i + 1 >= n || b[i + 1] == b'\\' {
        return false;
    }
    let ident = b[i + 1].is_ascii_alphabetic() || b[i + 1] == b'_';
    ident && !(i + 2 < n && b[i + 2] == b'\'')
}

fn scan_string(b: &[u8], mut i: usize, lang: Language) -> usize {
    let n = b.len();
    let q = b[i];
    if lang == Language::Python && b[i..].starts_with(&[q, q, q]) {
        i += 3;
        while i < n && !b[i..].starts_with(&[q, q, q]) {
            i += if b[i] == b'\\' { 2 } else { 1 };
        }
        return (i + 3).min(n);
    }
    i += 1;
    while i < n && b[i] != q {
        if b[i] == b'\\' {
            i += 1;
        } else if b[i] == b'\n' && q != b'`' && !(lang == Language::Rust && q == b'"') {
            return i;
        }
        i += 1;
    }
    (i + 1).min(n)
}

fn scan_number(b: &[u8], mut i: usize) -> usize {
    let n = b.len();
    let hex = b[i..].starts_with(b"0x") || b[i..].starts_with(b"0X");
    if hex {
        i += 2;
    }
    while i < n {
        let c = b[i];
        if c.is_ascii_alphanumeric() || c == b'_' {
            if !hex
                && (c == b'e' || c == b'E')
                && i + 1 < n
                && (b[i + 1] == b'+' || b[i + 1] == b'-')
            {
                i += 2;
                continue;
            }
            i += 1;
        } else if c == b'.' && i + 1 < n && b[i + 1].is_ascii_digit() {
            i += 1;
        } else {
            break;
        }
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(src: &str, lang: Language) -> Vec<(Kind, &str)> {
        let l = Lexed::new(src, lang);
        (0..l.toks.len())
            .map(|k| (l.toks[k].kind, l.text(k)))
            .collect()
    }

    #[test]
    fn strings_comments_and_operators() {
        let v = kinds("x = f\"{a}\" # c\ny //= 2.5e-3", Language::Python);
        assert_eq!(
            v,
            vec![
                (Kind::Ident, "x"),
                (Kind::Punct, "="),
                (Kind::Str, "f\"{a}\""),
                (Kind::Comment, "# c"),
                (Kind::Ident, "y"),
                (Kind::Punct, "//="),
                (Kind::Number, "2.5e-3"),
            ]
        );
        let v = kinds(
            "fn f<'a>(s: &'a str) -> char { 'x' } // end",
            Language::Rust,
        );
        assert!(v.contains(&(Kind::Str, "'x'")));
        assert!(v.contains(&(Kind::Punct, "->")));
        assert!(v.contains(&(Kind::Comment, "// end")));
        assert!(!v.iter().any(|(k, t)| *k == Kind::Str && t.contains('a')));
        let v = kinds("a = `t ${b}`; /* c */ for (0..10)", Language::JavaScript);
        assert!(v.contains(&(Kind::Str, "`t ${b}`")));
        assert!(v.contains(&(Kind::Comment, "/* c */")));
    }

    #[test]
    fn lines() {
        let l = Lexed::new("a\nbb\n\nc", Language::C);
        assert_eq!(l.line_starts, vec![0, 2, 5, 6]);
        assert_eq!(l.line_of(3), 1);
        assert_eq!(l.line_span(1), (2, 4));
        assert_eq!(l.line_span(3), (6, 7));
    }
}
