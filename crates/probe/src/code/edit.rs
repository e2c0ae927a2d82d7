//! The seven edit archetypes of Mode D (PROTOCOL.md section 10), applied
//! programmatically with lexical rules.
//!
//! Each archetype is a deterministic function of the source text, its
//! language and a seed: it lists every site its rule accepts, in source
//! order, picks one with the seed ([`Rng`]), and returns the edited text; a
//! source with no site is a typed [`NoSite`], never a silent drop. An edit
//! changes text at or after its [`Edit::offset`] (the first byte where the
//! two texts differ) and leaves everything before it unchanged; a rename or
//! an added argument may change several sites, all at or after it.
//!
//! The rules read the tokens of a small lexer (identifiers, numbers,
//! strings, comments, punctuation; text in strings and comments is never
//! edited). They aim at edits a programmer makes and that keep the file
//! syntactically valid on the corpus; they do not type-check (an inserted
//! local is unused, a deleted statement may leave a value unread).

use super::lex::{Kind, Lexed, Tok};
use super::Language;
use crate::rng::Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// An edit archetype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Archetype {
    /// Rename an identifier at every occurrence.
    ///
    /// Candidates: an identifier of at least two characters that occurs at
    /// least three times in code; that is not a keyword or a well-known
    /// builtin, type or module of the language, nor a dunder name; none of
    /// whose occurrences follows `.`, `?.`, `->` or `::` (a member or path:
    /// fields, methods and library items are left alone) or precedes `!` (a
    /// Rust macro); that never occurs on an import line (`import`, `from`,
    /// `use`, `package`, `#include`, `require(`); and that does not occur as
    /// a word inside any string literal (template literals and f-strings
    /// would keep the old name). The new name appends a seeded word in the
    /// name's style (`count` → `count_value`, `itemCount` → `itemCountValue`,
    /// `MAX` → `MAX_VALUE`) and does not occur in the file.
    RenameIdentifier,
    /// Add a parameter to a function and an argument to every call of it.
    ///
    /// Candidates: a function defined exactly once in the file (`def f(`,
    /// `fn f(`, `func f(` or `func (r T) f(`, `function f(`, or a
    /// JavaScript/TypeScript method or C function: `f(...)` followed by a
    /// body `{`, with a TypeScript return type allowed between), called at
    /// least once, whose name occurs nowhere else than at the definition
    /// and at calls (`f(`, `.f(`, `::f(`), and whose parameter list has no
    /// rest or variadic parameter. The parameter takes a seeded name not in
    /// the file and is appended with the language's syntax (`limit=3` in
    /// Python, `limit: usize` in Rust, `limit int` in Go, `int limit` in C,
    /// `limit = 3` in JavaScript, `limit: number = 3` in TypeScript; a C
    /// `(void)` is replaced); each call gets a seeded small integer
    /// (`limit=5` in Python).
    AddArgument,
    /// Negate the condition of an `if`, `elif` or `while`.
    ///
    /// Candidates: in Python, `if`/`elif`/`while` opening a line whose last
    /// code token is the `:` that ends the condition; in C, JavaScript and
    /// TypeScript, `if (...)`/`while (...)`; in Rust and Go, `if`/`while`
    /// (not `if let`/`while let`) whose condition runs to a `{` ending the
    /// line, without `:=` or `;` (Go's init statements). A condition that
    /// starts with a negation (`not `, `!`) loses it; any other is wrapped:
    /// `not (cond)`, `!(cond)`.
    ChangeConditional,
    /// Change a numeric literal.
    ///
    /// Candidates: every numeric literal in code, except a multi-digit
    /// literal with a leading zero (octal in C and Go). The last digit of
    /// the literal's mantissa (before an exponent or a type suffix) changes:
    /// a decimal digit `d` becomes `d + 1` (9 becomes 8), a hexadecimal
    /// digit `v` becomes `(v + 1) mod 16`.
    ChangeLiteral,
    /// Change a binary arithmetic operator.
    ///
    /// Candidates: `+ - * / %` and their compound assignments (`+=` ...)
    /// with whitespace on both sides, whose left token ends an operand (an
    /// identifier that is not a keyword, a number, `)` or `]`), and with no
    /// string literal on either side (so no string concatenation). The
    /// operator is swapped: `+` ↔ `-`, `*` ↔ `/`, `%` → `/`.
    ChangeOperator,
    /// Insert a statement between two statements of a function body.
    ///
    /// Candidates: a line `L` that starts a statement (its first code token
    /// is an identifier or keyword other than a continuation such as `else`,
    /// `elif`, `except`, `catch`, `case`, `default`; no open bracket at its
    /// start), directly after a line at the same indentation that ends a
    /// statement (`;` or a lone `}` in C, Rust, JavaScript and TypeScript; a
    /// line ending in an identifier, literal, `)`, `]`, `}`, `++` or `--` in
    /// Go and Python), inside a function or control block (the innermost `{`
    /// opens a function, method, closure or control block, not a struct,
    /// class, impl, match or object literal; in Python the enclosing header
    /// is `def`, `if`, `for`, `while`, `with`, `try`, `else`, `elif`,
    /// `except` or `finally`). The inserted line, at `L`'s indentation,
    /// declares a local with a seeded name not in the file and a seeded
    /// integer: `marker = 7`, `let marker = 7;`, `const marker = 7;`,
    /// `int marker = 7;`, `marker := 7`.
    InsertStatement,
    /// Delete a one-line statement of a function body.
    ///
    /// Candidates: a line that holds exactly one simple statement (no open
    /// bracket at its start or end, no brace on it, ending in `;` in C, Rust,
    /// JavaScript and TypeScript, in an identifier, literal, `)`, `]`, `++`
    /// or `--` in Go and Python), not followed by a continuation line, inside
    /// a function or control block (as for insertion), that is not a
    /// declaration, definition or jump (`let`, `const`, `var`, `return`,
    /// `break`, `pass`, `if`, `for`, ..., a C declaration `T x ...`, a Go
    /// `:=`), and whose plain assignment (`x = ...`, `a, b = ...`) binds
    /// names that occur earlier (in Python, earlier in the enclosing `def`,
    /// so it is not a first binding; elsewhere a plain assignment assigns a
    /// declared name). In Python the line must have a sibling statement at
    /// the same indentation, so the block is not left empty. The whole line
    /// (with its newline) is removed.
    DeleteStatement,
}

impl Archetype {
    /// Every archetype, in a fixed order.
    pub const ALL: [Archetype; 7] = [
        Archetype::RenameIdentifier,
        Archetype::AddArgument,
        Archetype::ChangeConditional,
        Archetype::ChangeLiteral,
        Archetype::ChangeOperator,
        Archetype::InsertStatement,
        Archetype::DeleteStatement,
    ];

    /// The snake-case name (`rename_identifier`), used in pair ids.
    pub fn name(self) -> &'static str {
        match self {
            Archetype::RenameIdentifier => "rename_identifier",
            Archetype::AddArgument => "add_argument",
            Archetype::ChangeConditional => "change_conditional",
            Archetype::ChangeLiteral => "change_literal",
            Archetype::ChangeOperator => "change_operator",
            Archetype::InsertStatement => "insert_statement",
            Archetype::DeleteStatement => "delete_statement",
        }
    }

    /// The archetype of a snake-case name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// What this archetype reports when its rule finds no site.
    pub fn no_site(self) -> NoSite {
        match self {
            Archetype::RenameIdentifier => NoSite::NoRenamableIdentifier,
            Archetype::AddArgument => NoSite::NoCalledFunction,
            Archetype::ChangeConditional => NoSite::NoConditional,
            Archetype::ChangeLiteral => NoSite::NoNumericLiteral,
            Archetype::ChangeOperator => NoSite::NoArithmeticOperator,
            Archetype::InsertStatement => NoSite::NoInsertionPoint,
            Archetype::DeleteStatement => NoSite::NoDeletableStatement,
        }
    }

    /// Applies the archetype to `src`: every site the rule accepts is
    /// listed in source order and one is picked with `seed`. Same inputs,
    /// same edit.
    pub fn apply(self, src: &str, lang: Language, seed: u64) -> Result<Edit, NoSite> {
        let code = Code::new(src, lang);
        let mut rng = Rng::new(seed);
        let planned = match self {
            Archetype::RenameIdentifier => code.rename(&mut rng),
            Archetype::AddArgument => code.add_argument(&mut rng),
            Archetype::ChangeConditional => code.change_conditional(&mut rng),
            Archetype::ChangeLiteral => code.change_literal(&mut rng),
            Archetype::ChangeOperator => code.change_operator(&mut rng),
            Archetype::InsertStatement => code.insert_statement(&mut rng),
            Archetype::DeleteStatement => code.delete_statement(&mut rng),
        };
        let (reps, description) = planned.ok_or(self.no_site())?;
        Edit::from_replacements(self, src, reps, description).ok_or(self.no_site())
    }
}

impl std::fmt::Display for Archetype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why an archetype found nothing to edit in a source (a recorded skip).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum NoSite {
    /// No identifier passes the rename rule.
    #[error("no identifier occurs three times outside members, imports and strings")]
    NoRenamableIdentifier,
    /// No function defined once and called in the file.
    #[error("no function is defined once and called, with its name used only at calls")]
    NoCalledFunction,
    /// No `if`/`elif`/`while` condition the rule can delimit.
    #[error("no if/elif/while condition")]
    NoConditional,
    /// No numeric literal in code.
    #[error("no numeric literal")]
    NoNumericLiteral,
    /// No binary arithmetic operator with an operand on each side.
    #[error("no binary arithmetic operator")]
    NoArithmeticOperator,
    /// No statement boundary inside a function or control block.
    #[error("no statement boundary inside a function body")]
    NoInsertionPoint,
    /// No one-line statement that can be deleted.
    #[error("no deletable one-line statement")]
    NoDeletableStatement,
}

/// An applied edit: the edited text and where it differs from the original.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Edit {
    /// The archetype applied.
    pub archetype: Archetype,
    /// The edited source.
    pub edited: String,
    /// The first byte where the original and the edited text differ: every
    /// byte before it is unchanged.
    pub offset: usize,
    /// The line of `offset`, 1-based.
    pub line: usize,
    /// That line in the original (without its newline).
    pub before: String,
    /// The line with the same number in the edited text.
    pub after: String,
    /// How many places changed (occurrences renamed, definition and calls).
    pub sites: usize,
    /// What was done, in words (`rename `total` to `total_value` (4 sites)`).
    pub description: String,
}

/// A replacement of the byte range `start..end` by `text`.
type Rep = (usize, usize, String);

impl Edit {
    fn from_replacements(
        archetype: Archetype,
        src: &str,
        mut reps: Vec<Rep>,
        description: String,
    ) -> Option<Edit> {
        reps.sort_by_key(|r| (r.0, r.1));
        let mut edited = String::with_capacity(src.len() + 64);
        let mut at = 0;
        for (s, e, t) in &reps {
            debug_assert!(*s >= at && *e >= *s, "overlapping replacements");
            edited.push_str(&src[at..*s]);
            edited.push_str(t);
            at = *e;
        }
        edited.push_str(&src[at..]);
        if edited == src {
            return None;
        }
        let mut offset = src
            .bytes()
            .zip(edited.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        while !src.is_char_boundary(offset) {
            offset -= 1;
        }
        let line = src[..offset].matches('\n').count();
        let nth = |t: &str| t.split('\n').nth(line).unwrap_or("").to_string();
        Some(Edit {
            archetype,
            offset,
            line: line + 1,
            before: nth(src),
            after: nth(&edited),
            sites: reps.len(),
            description,
            edited,
        })
    }
}

// ---------------------------------------------------------------------------
// Language word lists.

#[rustfmt::skip]
const PY_WORDS: &[&str] = &[
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue",
    "def", "del", "elif", "else", "except", "finally", "for", "from", "global", "if", "import",
    "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return", "try", "while",
    "with", "yield", "self", "cls", "print", "len", "range", "int", "str", "float", "list", "dict",
    "set", "tuple", "bool", "min", "max", "sum", "abs", "sorted", "enumerate", "zip", "isinstance",
    "super", "object", "Exception", "ValueError", "KeyError", "TypeError", "IndexError",
    "RuntimeError", "open", "round", "any", "all", "map", "filter", "iter", "next", "repr", "hash",
    "id", "type", "reversed", "dataclass", "field", "property", "staticmethod", "classmethod",
    "Optional", "List", "Dict",
];

#[rustfmt::skip]
const RS_WORDS: &[&str] = &[
    "as", "break", "const", "continue", "crate", "else", "enum", "extern", "false", "fn", "for",
    "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut", "pub", "ref", "return",
    "self", "Self", "static", "struct", "super", "trait", "true", "type", "unsafe", "use", "where",
    "while", "dyn", "async", "await", "Vec", "String", "Option", "Some", "None", "Ok", "Err",
    "Result", "Box", "HashMap", "HashSet", "BTreeMap", "BTreeSet", "VecDeque", "usize", "isize",
    "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64", "f32", "f64", "bool", "char", "str",
    "std", "collections", "fmt", "Display", "Debug", "Clone", "Copy", "PartialEq", "Eq", "Hash",
    "Default", "derive", "new", "len", "push", "pop", "iter", "map", "unwrap", "Iterator", "Item",
    "From", "Into", "Ord", "PartialOrd",
];

#[rustfmt::skip]
const GO_WORDS: &[&str] = &[
    "break", "case", "chan", "const", "continue", "default", "defer", "else", "fallthrough", "for",
    "func", "go", "goto", "if", "import", "interface", "map", "package", "range", "return",
    "select", "struct", "switch", "type", "var", "nil", "true", "false", "int", "int8", "int16",
    "int32", "int64", "uint", "uint8", "uint16", "uint32", "uint64", "byte", "rune", "string",
    "bool", "float32", "float64", "error", "len", "cap", "make", "append", "new", "panic", "copy",
    "delete", "fmt", "strings", "errors", "sort", "sync", "time", "main", "any", "min", "max",
];

#[rustfmt::skip]
const C_WORDS: &[&str] = &[
    "auto", "break", "case", "char", "const", "continue", "default", "do", "double", "else", "enum",
    "extern", "float", "for", "goto", "if", "inline", "int", "long", "register", "return", "short",
    "signed", "sizeof", "static", "struct", "switch", "typedef", "union", "unsigned", "void",
    "volatile", "while", "bool", "true", "false", "NULL", "size_t", "uint8_t", "uint16_t",
    "uint32_t", "uint64_t", "int8_t", "int16_t", "int32_t", "int64_t", "FILE", "printf", "fprintf",
    "malloc", "free", "memcpy", "memset", "strlen", "strcmp", "strncmp", "calloc", "realloc",
    "assert", "include", "define", "stdio", "stdlib", "string", "stdint", "stdbool", "h", "main",
    "isspace", "isdigit", "isalpha", "isalnum", "ctype", "stderr", "stdout", "puts", "putchar",
];

#[rustfmt::skip]
const JS_WORDS: &[&str] = &[
    "break", "case", "catch", "class", "const", "continue", "debugger", "default", "delete", "do",
    "else", "export", "extends", "finally", "for", "function", "if", "import", "in", "instanceof",
    "let", "new", "return", "super", "switch", "this", "throw", "try", "typeof", "var", "void",
    "while", "with", "yield", "async", "await", "of", "null", "undefined", "true", "false",
    "static", "get", "set", "interface", "type", "enum", "implements", "private", "public",
    "protected", "readonly", "number", "string", "boolean", "any", "unknown", "never", "as",
    "console", "Math", "JSON", "Object", "Array", "Map", "Set", "Promise", "Error", "Number",
    "String", "Date", "Record", "Partial", "parseInt", "parseFloat", "require", "module", "exports",
    "constructor", "length", "setTimeout", "clearTimeout", "window", "document",
];

fn reserved(lang: Language, w: &str) -> bool {
    let list = match lang {
        Language::Python => PY_WORDS,
        Language::Rust => RS_WORDS,
        Language::Go => GO_WORDS,
        Language::C => C_WORDS,
        Language::JavaScript | Language::TypeScript => JS_WORDS,
    };
    list.contains(&w)
}

/// Words that cannot start a statement line (they continue a construct).
const CONTINUATIONS: &[&str] = &[
    "else", "elif", "except", "finally", "catch", "case", "default",
];

/// Words that make a line a declaration, definition or jump (not deleted).
#[rustfmt::skip]
const NOT_DELETED: &[&str] = &[
    "let", "const", "var", "return", "break", "continue", "throw", "raise", "pass", "yield",
    "static", "def", "fn", "func", "function", "class", "struct", "type", "import", "from", "use",
    "package", "goto", "global", "nonlocal", "if", "for", "while", "with", "try", "match", "switch",
    "loop", "do", "pub", "mod", "impl", "enum", "interface", "export", "typedef", "extern",
    "unsigned", "signed", "long", "short", "int", "char", "float", "double", "void", "bool",
    "size_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t", "int8_t", "int16_t", "int32_t",
    "int64_t", "else", "elif", "except", "finally", "catch", "case", "default", "async", "assert",
    "defer", "go", "del",
];

/// Words that open a block of statements on their line.
#[rustfmt::skip]
const BLOCK_OPENERS: &[&str] = &[
    "fn", "func", "function", "if", "else", "for", "while", "loop", "do", "try", "catch", "finally",
    "unsafe",
];

/// Words that open a block of declarations, fields or arms.
#[rustfmt::skip]
const NON_CODE_BLOCKS: &[&str] = &[
    "struct", "enum", "impl", "class", "trait", "interface", "match", "union", "type", "mod",
    "select",
];

/// Python headers whose body is code.
#[rustfmt::skip]
const PY_CODE_HEADERS: &[&str] = &[
    "def", "if", "elif", "else", "for", "while", "with", "try", "except", "finally", "async",
];

#[rustfmt::skip]
const PARAM_NAMES: &[&str] = &[
    "limit", "depth", "retries", "scale", "margin", "weight", "budget", "stride",
];
const LOCAL_NAMES: &[&str] = &[
    "marker",
    "sentinel",
    "checkpoint",
    "tally",
    "probe",
    "beacon",
];
const RENAME_WORDS: &[&str] = &["value", "data", "item", "entry", "info", "ref"];

// ---------------------------------------------------------------------------
// Lexical analysis shared by the archetypes.

/// A line of the source as the statement rules see it.
#[derive(Debug, Clone, Default)]
struct Line {
    /// First and last code tokens on the line (indices into `Code::t`).
    first: Option<usize>,
    last: Option<usize>,
    /// Open `(`/`[` (and `{` in Python) at the line's start and end.
    depth_start: usize,
    depth_end: usize,
    /// The innermost open `{` at the line's start (index into `Code::t`).
    block: Option<usize>,
    /// Whether the line starts inside a token (a multi-line string or comment).
    inside: bool,
    /// Leading whitespace, in bytes.
    indent: usize,
}

struct Code<'a> {
    src: &'a str,
    lang: Language,
    lx: Lexed<'a>,
    /// Code tokens (comments left out).
    t: Vec<Tok>,
    lines: Vec<Line>,
    /// Matching bracket of each bracket token, both ways.
    pair: Vec<Option<usize>>,
}

impl<'a> Code<'a> {
    fn new(src: &'a str, lang: Language) -> Self {
        let lx = Lexed::new(src, lang);
        let t: Vec<Tok> = lx
            .toks
            .iter()
            .copied()
            .filter(|t| t.kind != Kind::Comment)
            .collect();
        let nl = lx.line_starts.len();
        let mut lines = vec![Line::default(); nl];
        for (l, line) in lines.iter_mut().enumerate() {
            let (s, e) = lx.line_span(l);
            line.indent = src[s..e]
                .bytes()
                .take_while(|b| *b == b' ' || *b == b'\t')
                .count();
            line.inside = lx.toks.iter().any(|t| t.start < s && t.end > s);
        }
        let mut pair = vec![None; t.len()];
        let mut stack: Vec<usize> = Vec::new();
        let mut last_line = usize::MAX;
        let depth = |stack: &[usize], t: &[Tok]| {
            stack
                .iter()
                .filter(|&&k| {
                    let c = src.as_bytes()[t[k].start];
                    c != b'{' || lang == Language::Python
                })
                .count()
        };
        for k in 0..t.len() {
            let l = lx.line_of(t[k].start);
            if l != last_line {
                if last_line != usize::MAX {
                    lines[last_line].depth_end = depth(&stack, &t);
                }
                lines[l].first = Some(k);
                lines[l].depth_start = depth(&stack, &t);
                lines[l].block = stack
                    .iter()
                    .rev()
                    .copied()
                    .find(|&o| src.as_bytes()[t[o].start] == b'{');
                last_line = l;
            }
            lines[l].last = Some(k);
            if t[k].kind == Kind::Punct {
                match &src[t[k].start..t[k].end] {
                    "(" | "[" | "{" => stack.push(k),
                    ")" | "]" | "}" => {
                        if let Some(o) = stack.pop() {
                            pair[o] = Some(k);
                            pair[k] = Some(o);
                        }
                    }
                    _ => {}
                }
            }
        }
        if last_line != usize::MAX {
            lines[last_line].depth_end = depth(&stack, &t);
        }
        Self {
            src,
            lang,
            lx,
            t,
            lines,
            pair,
        }
    }

    fn text(&self, k: usize) -> &'a str {
        &self.src[self.t[k].start..self.t[k].end]
    }

    fn kind(&self, k: usize) -> Kind {
        self.t[k].kind
    }

    fn is(&self, k: usize, p: &str) -> bool {
        self.t[k].kind == Kind::Punct && self.text(k) == p
    }

    fn word(&self, k: usize, w: &str) -> bool {
        self.t[k].kind == Kind::Ident && self.text(k) == w
    }

    fn line(&self, k: usize) -> usize {
        self.lx.line_of(self.t[k].start)
    }

    /// Code tokens on the same line as `k`, up to and including `k`.
    fn line_upto(&self, k: usize) -> std::ops::RangeInclusive<usize> {
        let l = self.line(k);
        self.lines[l].first.unwrap_or(k)..=k
    }

    /// Whether `{` at `k` opens a block of statements.
    fn code_block(&self, k: usize) -> bool {
        let on_line: Vec<usize> = self.line_upto(k).collect();
        let words = |list: &[&str]| {
            on_line
                .iter()
                .any(|&j| self.kind(j) == Kind::Ident && list.contains(&self.text(j)))
        };
        if words(BLOCK_OPENERS) || on_line.iter().any(|&j| self.is(j, "=>")) {
            return true;
        }
        if words(NON_CODE_BLOCKS) || k == 0 {
            return false;
        }
        if matches!(
            self.lang,
            Language::C | Language::JavaScript | Language::TypeScript
        ) {
            let before = k - 1;
            if self.is(before, ")") {
                return true;
            }
            // A TypeScript method with a return type: `name(...): T {`.
            let typed = on_line
                .windows(2)
                .any(|w| self.is(w[0], ")") && self.is(w[1], ":"));
            return typed
                && (self.kind(before) == Kind::Ident
                    || self.is(before, ">")
                    || self.is(before, "]"));
        }
        false
    }

    /// Whether line `l` lies in a function or control block.
    fn in_code(&self, l: usize) -> bool {
        if self.lang == Language::Python {
            let ind = self.lines[l].indent;
            if ind == 0 {
                return false;
            }
            // The header: the nearest previous statement line indented less.
            for h in (0..l).rev() {
                let hl = &self.lines[h];
                if let (Some(f), false, 0) = (hl.first, hl.inside, hl.depth_start) {
                    if self.line(f) == h && hl.indent < ind {
                        return self.kind(f) == Kind::Ident
                            && PY_CODE_HEADERS.contains(&self.text(f));
                    }
                }
            }
            return false;
        }
        self.lines[l].block.is_some_and(|b| self.code_block(b))
    }

    /// Whether line `l` starts a statement at bracket depth 0.
    fn statement_start(&self, l: usize) -> Option<usize> {
        let line = &self.lines[l];
        let f = line.first?;
        (!line.inside && line.depth_start == 0 && self.line(f) == l).then_some(f)
    }

    /// Whether the last code token of line `l` ends a statement.
    fn ends_statement(&self, l: usize) -> bool {
        let line = &self.lines[l];
        let (Some(f), Some(k)) = (line.first, line.last) else {
            return false;
        };
        if line.depth_end != 0 || self.line(k) != l {
            return false;
        }
        match self.lang {
            Language::Python | Language::Go => {
                matches!(self.kind(k), Kind::Ident | Kind::Number | Kind::Str)
                    || [")", "]", "}", "++", "--"].iter().any(|p| self.is(k, p))
                        && !(self.lang == Language::Python && self.is(k, "++"))
            }
            _ => self.is(k, ";") || (f == k && self.is(k, "}")),
        }
    }

    /// The nearest line after `l` with code, if any.
    fn next_code_line(&self, l: usize) -> Option<usize> {
        (l + 1..self.lines.len()).find(|&m| self.lines[m].first.is_some_and(|f| self.line(f) == m))
    }

    /// The nearest line before `l` with code, if any.
    fn prev_code_line(&self, l: usize) -> Option<usize> {
        (0..l)
            .rev()
            .find(|&m| self.lines[m].first.is_some_and(|f| self.line(f) == m))
    }

    /// Where names bound before line `l` can be: in Python, the enclosing
    /// `def` (an assignment there may be a name's first binding); elsewhere
    /// the whole file (an assignment without a declaration keyword assigns a
    /// name declared before).
    fn scope_start(&self, l: usize) -> usize {
        if self.lang != Language::Python {
            return 0;
        }
        let ind = self.lines[l].indent;
        (0..l)
            .rev()
            .filter_map(|h| self.statement_start(h).map(|f| (h, f)))
            .find(|&(h, f)| self.lines[h].indent < ind && self.word(f, "def"))
            .map_or(0, |(_, f)| f)
    }

    /// Lines that start with an import.
    fn import_lines(&self) -> Vec<bool> {
        let mut v = vec![false; self.lines.len()];
        for (l, line) in self.lines.iter().enumerate() {
            let Some(f) = line.first else { continue };
            let last = line.last.unwrap_or(f);
            let first_word = self.text(f);
            v[l] = ["import", "from", "use", "package", "#"].contains(&first_word)
                || (f..=last).any(|k| self.word(k, "require"));
        }
        // Go's `import ( ... )` block.
        for k in 0..self.t.len() {
            if self.word(k, "import") && k + 1 < self.t.len() && self.is(k + 1, "(") {
                if let Some(c) = self.pair[k + 1] {
                    for flag in &mut v[self.line(k)..=self.line(c)] {
                        *flag = true;
                    }
                }
            }
        }
        v
    }

    /// Whether `w` occurs as an identifier anywhere in the code.
    fn used(&self, w: &str) -> bool {
        (0..self.t.len()).any(|k| self.word(k, w))
    }

    /// Where to insert `item` into the bracketed list `open..close`, and
    /// with which separator: after the last token (`, item`, or ` item`
    /// after a trailing comma), or inside empty brackets.
    fn append_to_list(&self, open: usize, close: usize, item: &str) -> Rep {
        if close == open + 1 {
            return (self.t[close].start, self.t[close].start, item.to_string());
        }
        let last = close - 1;
        let at = self.t[last].end;
        if self.is(last, ",") {
            (at, at, format!(" {item}"))
        } else {
            (at, at, format!(", {item}"))
        }
    }

    // -----------------------------------------------------------------------
    // The archetypes.

    fn rename(&self, rng: &mut Rng) -> Option<(Vec<Rep>, String)> {
        let imports = self.import_lines();
        let mut occ: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for k in 0..self.t.len() {
            if self.kind(k) == Kind::Ident {
                occ.entry(self.text(k)).or_default().push(k);
            }
        }
        let in_strings: Vec<&str> = self
            .lx
            .toks
            .iter()
            .filter(|t| t.kind == Kind::Str)
            .map(|t| &self.src[t.start..t.end])
            .collect();
        let word_in = |w: &str, s: &str| {
            s.match_indices(w).any(|(i, _)| {
                let b = s.as_bytes();
                let edge = |c: u8| !(c.is_ascii_alphanumeric() || c == b'_');
                (i == 0 || edge(b[i - 1])) && (i + w.len() == s.len() || edge(b[i + w.len()]))
            })
        };
        let candidates: Vec<(&str, &Vec<usize>)> = occ
            .iter()
            .filter(|(w, ks)| {
                w.len() >= 2
                    && ks.len() >= 3
                    && !reserved(self.lang, w)
                    && !(w.starts_with("__") && w.ends_with("__"))
                    && ks.iter().all(|&k| {
                        let member =
                            k > 0 && [".", "?.", "->", "::"].iter().any(|p| self.is(k - 1, p));
                        let mac = k + 1 < self.t.len() && self.is(k + 1, "!");
                        !member && !mac && !imports[self.line(k)]
                    })
                    && !in_strings.iter().any(|s| word_in(w, s))
            })
            .map(|(w, ks)| (*w, ks))
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let (name, ks) = *rng.pick(&candidates);
        let word = *rng.pick(RENAME_WORDS);
        let cap = |s: &str| s[..1].to_uppercase() + &s[1..];
        let upper = name.bytes().all(|b| !b.is_ascii_lowercase());
        let snake = name.contains('_')
            || matches!(self.lang, Language::Python | Language::Rust | Language::C);
        let new = if upper {
            format!("{name}_{}", word.to_uppercase())
        } else if snake && !name.as_bytes()[0].is_ascii_uppercase() {
            format!("{name}_{word}")
        } else {
            format!("{name}{}", cap(word))
        };
        if self.used(&new) || self.src.contains(&new) {
            return None;
        }
        let reps = ks
            .iter()
            .map(|&k| (self.t[k].start, self.t[k].end, new.clone()))
            .collect();
        Some((
            reps,
            format!("rename `{name}` to `{new}` ({} sites)", ks.len()),
        ))
    }

    /// Function definitions: (name token, open paren, close paren).
    fn definitions(&self) -> Vec<(usize, usize, usize)> {
        let n = self.t.len();
        let mut out = Vec::new();
        for k in 0..n.saturating_sub(1) {
            if self.kind(k) != Kind::Ident
                || !self.is(k + 1, "(")
                || reserved(self.lang, self.text(k))
            {
                continue;
            }
            let Some(close) = self.pair[k + 1] else {
                continue;
            };
            let prev = k.checked_sub(1);
            let after_kw = |w: &str| prev.is_some_and(|p| self.word(p, w));
            let is_def = match self.lang {
                Language::Python => after_kw("def"),
                Language::Rust => after_kw("fn"),
                Language::Go => {
                    after_kw("func")
                        || prev.is_some_and(|p| {
                            self.is(p, ")")
                                && self.pair[p].is_some_and(|o| o > 0 && self.word(o - 1, "func"))
                        })
                }
                Language::JavaScript | Language::TypeScript | Language::C => {
                    let body = self.body_after(close);
                    let not_call = prev.is_none_or(|p| !(self.is(p, ".") || self.word(p, "new")));
                    after_kw("function") || (body && not_call && self.lang_def_prefix(k))
                }
            };
            if is_def {
                out.push((k, k + 1, close));
            }
        }
        out
    }

    /// Whether a `{` follows the parameter list closing at `close` (with a
    /// TypeScript return type allowed between, on the same line).
    fn body_after(&self, close: usize) -> bool {
        let n = self.t.len();
        if close + 1 >= n {
            return false;
        }
        if self.is(close + 1, "{") {
            return true;
        }
        if self.lang == Language::TypeScript && self.is(close + 1, ":") {
            let l = self.line(close);
            return (close + 2..n)
                .take_while(|&j| self.line(j) == l)
                .any(|j| self.is(j, "{"))
                && self.lines[l].last.is_some_and(|j| self.is(j, "{"));
        }
        false
    }

    /// For C, JavaScript and TypeScript: whether the name at `k` sits where a
    /// definition's name does (a C return type before it; the start of a
    /// line, after modifiers, for a method).
    fn lang_def_prefix(&self, k: usize) -> bool {
        let l = self.line(k);
        let first = self.lines[l].first.unwrap_or(k);
        if self.lang == Language::C {
            return first < k && (first..k).all(|j| self.kind(j) == Kind::Ident || self.is(j, "*"));
        }
        #[rustfmt::skip]
const MODIFIERS: &[&str] = &[
    "static", "async", "private", "public", "protected", "export", "get", "set",
];
        (first..k).all(|j| self.kind(j) == Kind::Ident && MODIFIERS.contains(&self.text(j)))
    }

    fn add_argument(&self, rng: &mut Rng) -> Option<(Vec<Rep>, String)> {
        let defs = self.definitions();
        let mut count: BTreeMap<&str, usize> = BTreeMap::new();
        for d in &defs {
            *count.entry(self.text(d.0)).or_default() += 1;
        }
        let mut candidates = Vec::new();
        for &(name_k, open, close) in &defs {
            let name = self.text(name_k);
            if count[name] != 1 {
                continue;
            }
            let variadic = (open + 1..close).any(|j| {
                ["*", "**", "..."].iter().any(|p| self.is(j, p))
                    && (j == open + 1 || self.is(j - 1, ","))
            });
            if variadic {
                continue;
            }
            let mut calls = Vec::new();
            let mut ok = true;
            for k in 0..self.t.len() {
                if k == name_k || !self.word(k, name) {
                    continue;
                }
                match (k + 1 < self.t.len() && self.is(k + 1, "("))
                    .then(|| self.pair[k + 1])
                    .flatten()
                {
                    Some(c) => calls.push((k + 1, c)),
                    None => ok = false,
                }
            }
            if ok && !calls.is_empty() {
                candidates.push((name_k, open, close, calls));
            }
        }
        if candidates.is_empty() {
            return None;
        }
        let (name_k, open, close, calls) = rng.pick(&candidates).clone();
        let free: Vec<&str> = PARAM_NAMES
            .iter()
            .copied()
            .filter(|p| !self.used(p))
            .collect();
        if free.is_empty() {
            return None;
        }
        let p = *rng.pick(&free);
        let default = 1 + rng.below(9);
        let param = match self.lang {
            Language::Python => format!("{p}={default}"),
            Language::Rust => format!("{p}: usize"),
            Language::Go => format!("{p} int"),
            Language::C => format!("int {p}"),
            Language::JavaScript => format!("{p} = {default}"),
            Language::TypeScript => format!("{p}: number = {default}"),
        };
        let mut reps = Vec::new();
        if self.lang == Language::C && close == open + 2 && self.word(open + 1, "void") {
            reps.push((self.t[open + 1].start, self.t[open + 1].end, param));
        } else {
            reps.push(self.append_to_list(open, close, &param));
        }
        for &(o, c) in &calls {
            let v = 1 + rng.below(9);
            let arg = if self.lang == Language::Python {
                format!("{p}={v}")
            } else {
                v.to_string()
            };
            // A call nested in another call's arguments is handled by its own
            // entry; insertion points never coincide with another's.
            reps.push(self.append_to_list(o, c, &arg));
        }
        let name = self.text(name_k);
        Some((
            reps,
            format!(
                "add parameter `{p}` to `{name}` and an argument to its {} call(s)",
                calls.len()
            ),
        ))
    }

    fn change_conditional(&self, rng: &mut Rng) -> Option<(Vec<Rep>, String)> {
        let n = self.t.len();
        let mut conds: Vec<(usize, usize)> = Vec::new(); // first and last code token of the condition
        for k in 0..n.saturating_sub(1) {
            let kw = self.kind(k) == Kind::Ident && ["if", "elif", "while"].contains(&self.text(k));
            if !kw {
                continue;
            }
            match self.lang {
                Language::Python => {
                    let l = self.line(k);
                    let (Some(f), Some(last)) = (self.lines[l].first, self.lines[l].last) else {
                        continue;
                    };
                    if f != k || !self.is(last, ":") || last <= k + 1 || self.line(last) != l {
                        continue;
                    }
                    if self.balanced(k + 1, last) {
                        conds.push((k + 1, last - 1));
                    }
                }
                Language::C | Language::JavaScript | Language::TypeScript => {
                    if self.is(k + 1, "(") {
                        if let Some(c) = self.pair[k + 1] {
                            if c > k + 2 {
                                conds.push((k + 2, c - 1));
                            }
                        }
                    }
                }
                Language::Rust | Language::Go => {
                    if self.text(k) == "elif" || self.word(k + 1, "let") {
                        continue;
                    }
                    let l = self.line(k);
                    let Some(last) = self.lines[l].last else {
                        continue;
                    };
                    if !self.is(last, "{")
                        || last <= k + 1
                        || self.line(last) != l
                        || !self.balanced(k + 1, last)
                    {
                        continue;
                    }
                    if (k + 1..last).any(|j| self.is(j, ":=") || self.is(j, ";") || self.is(j, "{"))
                    {
                        continue;
                    }
                    conds.push((k + 1, last - 1));
                }
            }
        }
        if conds.is_empty() {
            return None;
        }
        let (a, b) = *rng.pick(&conds);
        let (s, e) = (self.t[a].start, self.t[b].end);
        let cond = &self.src[s..e];
        let py = self.lang == Language::Python;
        let negated = if py {
            self.word(a, "not")
        } else {
            self.is(a, "!")
        };
        let (reps, new): (Vec<Rep>, String) = if negated && a < b {
            let rest = &self.src[self.t[a + 1].start..e];
            (
                vec![(s, self.t[a + 1].start, String::new())],
                rest.to_string(),
            )
        } else if py {
            (
                vec![(s, s, "not (".into()), (e, e, ")".into())],
                format!("not ({cond})"),
            )
        } else {
            (
                vec![(s, s, "!(".into()), (e, e, ")".into())],
                format!("!({cond})"),
            )
        };
        Some((reps, format!("negate `{cond}` to `{new}`")))
    }

    /// Whether the tokens `a..b` are bracket-balanced and never close more
    /// than they open.
    fn balanced(&self, a: usize, b: usize) -> bool {
        let mut d = 0i32;
        for j in a..b {
            if ["(", "[", "{"].iter().any(|p| self.is(j, p)) {
                d += 1;
            } else if [")", "]", "}"].iter().any(|p| self.is(j, p)) {
                d -= 1;
                if d < 0 {
                    return false;
                }
            }
        }
        d == 0
    }

    fn change_literal(&self, rng: &mut Rng) -> Option<(Vec<Rep>, String)> {
        let mut sites = Vec::new();
        for k in 0..self.t.len() {
            if self.kind(k) != Kind::Number {
                continue;
            }
            let s = self.text(k).as_bytes();
            let hex = s.len() > 2 && s[0] == b'0' && (s[1] == b'x' || s[1] == b'X');
            if !hex && s.len() > 1 && s[0] == b'0' && s[1].is_ascii_digit() {
                continue;
            }
            let from = if hex { 2 } else { 0 };
            let mantissa_end = (from..s.len())
                .find(|&i| {
                    let c = s[i];
                    if hex {
                        !(c.is_ascii_hexdigit() || c == b'_')
                    } else {
                        !(c.is_ascii_digit() || c == b'_' || c == b'.')
                    }
                })
                .unwrap_or(s.len());
            let digit = (from..mantissa_end)
                .rev()
                .find(|&i| s[i].is_ascii_hexdigit());
            if let Some(i) = digit {
                sites.push((k, i, hex));
            }
        }
        if sites.is_empty() {
            return None;
        }
        let (k, i, hex) = *rng.pick(&sites);
        let c = self.text(k).as_bytes()[i];
        let new = if hex {
            let v = (c as char).to_digit(16).expect("hex digit");
            let d = std::char::from_digit((v + 1) % 16, 16).expect("digit");
            if c.is_ascii_uppercase() {
                d.to_ascii_uppercase()
            } else {
                d
            }
        } else if c == b'9' {
            '8'
        } else {
            (c + 1) as char
        };
        let at = self.t[k].start + i;
        let old = self.text(k);
        let mut lit = old.to_string();
        lit.replace_range(i..i + 1, &new.to_string());
        Some((
            vec![(at, at + 1, new.to_string())],
            format!("change literal `{old}` to `{lit}`"),
        ))
    }

    fn change_operator(&self, rng: &mut Rng) -> Option<(Vec<Rep>, String)> {
        const SWAP: &[(&str, &str)] = &[
            ("+", "-"),
            ("-", "+"),
            ("*", "/"),
            ("/", "*"),
            ("%", "/"),
            ("+=", "-="),
            ("-=", "+="),
            ("*=", "/="),
            ("/=", "*="),
            ("%=", "/="),
        ];
        #[rustfmt::skip]
const NOT_OPERANDS: &[&str] = &[
    "return", "in", "and", "or", "not", "if", "else", "case", "yield", "await", "typeof", "await",
    "is", "elif", "while", "for", "of", "throw", "new", "delete", "void",
];
        let b = self.src.as_bytes();
        let space = |c: u8| c == b' ' || c == b'\t';
        let mut sites = Vec::new();
        for k in 1..self.t.len().saturating_sub(1) {
            if self.kind(k) != Kind::Punct {
                continue;
            }
            let Some(&(_, to)) = SWAP.iter().find(|(from, _)| *from == self.text(k)) else {
                continue;
            };
            let (s, e) = (self.t[k].start, self.t[k].end);
            if s == 0 || e >= b.len() || !space(b[s - 1]) || !space(b[e]) {
                continue;
            }
            let p = k - 1;
            let operand = match self.kind(p) {
                Kind::Ident => !NOT_OPERANDS.contains(&self.text(p)),
                Kind::Number => true,
                Kind::Punct => self.is(p, ")") || self.is(p, "]"),
                _ => false,
            };
            if operand && self.kind(k + 1) != Kind::Str && self.kind(k + 1) != Kind::Comment {
                sites.push((k, to));
            }
        }
        if sites.is_empty() {
            return None;
        }
        let (k, to) = *rng.pick(&sites);
        let l = self.line(k);
        let (ls, le) = self.lx.line_span(l);
        let desc = format!(
            "change `{}` to `{to}` in `{}`",
            self.text(k),
            self.src[ls..le].trim()
        );
        Some((vec![(self.t[k].start, self.t[k].end, to.to_string())], desc))
    }

    fn insert_statement(&self, rng: &mut Rng) -> Option<(Vec<Rep>, String)> {
        let mut sites = Vec::new();
        for l in 1..self.lines.len() {
            let Some(f) = self.statement_start(l) else {
                continue;
            };
            if self.kind(f) != Kind::Ident || CONTINUATIONS.contains(&self.text(f)) {
                continue;
            }
            let p = l - 1;
            if self.statement_start(p).is_none()
                || self.lines[p].indent != self.lines[l].indent
                || !self.ends_statement(p)
            {
                continue;
            }
            if self.in_code(l) {
                sites.push(l);
            }
        }
        if sites.is_empty() {
            return None;
        }
        let l = *rng.pick(&sites);
        let free: Vec<&str> = LOCAL_NAMES
            .iter()
            .copied()
            .filter(|w| !self.used(w))
            .collect();
        if free.is_empty() {
            return None;
        }
        let v = *rng.pick(&free);
        let n = 1 + rng.below(99);
        let stmt = match self.lang {
            Language::Python => format!("{v} = {n}"),
            Language::Rust => format!("let {v} = {n};"),
            Language::JavaScript | Language::TypeScript => format!("const {v} = {n};"),
            Language::C => format!("int {v} = {n};"),
            Language::Go => format!("{v} := {n}"),
        };
        let at = self.lx.line_starts[l];
        let indent = &self.src[at..at + self.lines[l].indent];
        Some((
            vec![(at, at, format!("{indent}{stmt}\n"))],
            format!("insert `{stmt}` before line {}", l + 1),
        ))
    }

    fn delete_statement(&self, rng: &mut Rng) -> Option<(Vec<Rep>, String)> {
        let mut sites = Vec::new();
        for l in 0..self.lines.len() {
            let Some(f) = self.statement_start(l) else {
                continue;
            };
            let last = self.lines[l]
                .last
                .expect("a line with a first token has a last");
            if self.kind(f) != Kind::Ident
                || NOT_DELETED.contains(&self.text(f))
                || !self.ends_statement(l)
            {
                continue;
            }
            if (f..=last).any(|j| self.is(j, "{") || self.is(j, "}") || self.is(j, ":=")) {
                continue;
            }
            // A C declaration: `T x`, `T *x`, `struct T x`.
            if self.lang == Language::C {
                let mut j = f + 1;
                while j <= last && self.is(j, "*") {
                    j += 1;
                }
                if j <= last && self.kind(j) == Kind::Ident && j > f {
                    continue;
                }
            }
            // A plain assignment binds names already seen.
            if let Some(eq) = (f..=last).find(|&j| self.is(j, "=")) {
                let lhs_plain = (f..eq).all(|j| self.kind(j) == Kind::Ident || self.is(j, ","));
                let from = self.scope_start(l);
                let seen = |j: usize| (from..f).any(|i| self.word(i, self.text(j)));
                if lhs_plain && !(f..eq).filter(|&j| self.kind(j) == Kind::Ident).all(seen) {
                    continue;
                }
            }
            if let Some(m) = self.next_code_line(l) {
                let nf = self.lines[m].first.expect("a code line");
                if self.kind(nf) == Kind::Punct && ![")", "]", "}"].contains(&self.text(nf)) {
                    continue;
                }
            }
            if self.lang == Language::Python {
                let ind = self.lines[l].indent;
                let sibling = |m: Option<usize>| {
                    m.is_some_and(|m| self.lines[m].indent == ind && !self.lines[m].inside)
                };
                if !(sibling(self.prev_code_line(l)) || sibling(self.next_code_line(l))) {
                    continue;
                }
            }
            if self.in_code(l) {
                sites.push(l);
            }
        }
        if sites.is_empty() {
            return None;
        }
        let l = *rng.pick(&sites);
        let s = self.lx.line_starts[l];
        let e = self
            .lx
            .line_starts
            .get(l + 1)
            .copied()
            .unwrap_or(self.src.len());
        let (ls, le) = self.lx.line_span(l);
        Some((
            vec![(s, e, String::new())],
            format!("delete line {}: `{}`", l + 1, self.src[ls..le].trim()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(a: Archetype, src: &str, lang: Language) -> Result<Edit, NoSite> {
        a.apply(src, lang, 0)
    }

    #[test]
    fn rename_skips_members_and_strings() {
        let src = "def f(total):\n    total = total + 1\n    print(\"total\")\n    return total\n";
        assert_eq!(
            apply(Archetype::RenameIdentifier, src, Language::Python),
            Err(NoSite::NoRenamableIdentifier)
        );
        let src = "def f(total):\n    total = total + 1\n    return total\n";
        let e = apply(Archetype::RenameIdentifier, src, Language::Python).unwrap();
        assert!(e.edited.contains("total_") && !e.edited.contains("(total)"));
        assert_eq!(e.sites, 4);
        assert_eq!(e.offset, 11); // `total` is a prefix of its new name
    }

    #[test]
    fn add_argument_in_every_language() {
        let cases = [
            (
                Language::Python,
                "def g(a):\n    return a\n\nx = g(1)\n",
                "def g(a, ",
            ),
            (
                Language::Rust,
                "fn g() -> u32 {\n    1\n}\nfn h() -> u32 {\n    g()\n}\n",
                ": usize)",
            ),
            (
                Language::C,
                "static int g(void) {\n    return 1;\n}\nint h(void) {\n    return g();\n}\n",
                "g(int ",
            ),
            (
                Language::Go,
                "func g(a int) int {\n\treturn a\n}\nfunc h() int {\n\treturn g(2)\n}\n",
                "g(a int, ",
            ),
            (
                Language::TypeScript,
                "function g(a: number): number {\n  return a;\n}\nconst y = g(2);\n",
                "g(a: number, ",
            ),
        ];
        for (lang, src, expect) in cases {
            let e = apply(Archetype::AddArgument, src, lang).unwrap();
            assert!(e.edited.contains(expect), "{lang:?}: {}", e.edited);
            assert_eq!(e.sites, 2, "{lang:?}");
        }
    }

    #[test]
    fn conditional_negates_or_drops_a_negation() {
        let e = apply(
            Archetype::ChangeConditional,
            "if x > 1:\n    y = 2\n",
            Language::Python,
        )
        .unwrap();
        assert_eq!(e.after, "if not (x > 1):");
        let e = apply(
            Archetype::ChangeConditional,
            "fn f() {\n    if !done {\n        g();\n    }\n}\n",
            Language::Rust,
        )
        .unwrap();
        assert_eq!(e.after, "    if done {");
        let e = apply(
            Archetype::ChangeConditional,
            "while (n < 3) n++;",
            Language::C,
        )
        .unwrap();
        assert_eq!(e.after, "while (!(n < 3)) n++;");
    }

    #[test]
    fn literal_and_operator() {
        let e = apply(Archetype::ChangeLiteral, "x = 19\n", Language::Python).unwrap();
        assert_eq!(e.after, "x = 18");
        let e = apply(Archetype::ChangeLiteral, "let m = 0xff;", Language::Rust).unwrap();
        assert_eq!(e.after, "let m = 0xf0;");
        let e = apply(Archetype::ChangeLiteral, "let m = 10u32;", Language::Rust).unwrap();
        assert_eq!(e.after, "let m = 11u32;");
        let e = apply(
            Archetype::ChangeOperator,
            "y = a * (b - 1)\nz = -y\n",
            Language::Python,
        );
        assert!(
            matches!(e.map(|e| e.after), Ok(s) if s == "y = a / (b - 1)" || s == "y = a * (b + 1)")
        );
        assert_eq!(
            apply(
                Archetype::ChangeOperator,
                "s = \"a\" + name\nt = -s\nu = *p\n",
                Language::Python
            ),
            Err(NoSite::NoArithmeticOperator)
        );
    }

    #[test]
    fn statements_stay_in_function_bodies() {
        let src =
            "struct P {\n    x: u32,\n}\nfn f(p: &mut P) {\n    p.x += 1;\n    p.x *= 2;\n}\n";
        let e = apply(Archetype::InsertStatement, src, Language::Rust).unwrap();
        assert!(
            e.edited.contains("    p.x += 1;\n    let ") && e.line == 6,
            "{}",
            e.edited
        );
        let e = apply(Archetype::DeleteStatement, src, Language::Rust).unwrap();
        assert_eq!(e.edited.matches("p.x").count(), 1);
        // A class body is not a function body; a lone statement in a Python
        // block is not deleted.
        let src = "class A {\n  x = 1;\n  y = 2;\n}\n";
        assert_eq!(
            apply(Archetype::InsertStatement, src, Language::JavaScript),
            Err(NoSite::NoInsertionPoint)
        );
        let src = "def f(a):\n    a.go()\n";
        assert_eq!(
            apply(Archetype::DeleteStatement, src, Language::Python),
            Err(NoSite::NoDeletableStatement)
        );
    }

    #[test]
    fn deterministic_in_the_seed() {
        let src = "x = 1 + 2 - 3 * 4\n";
        let a = Archetype::ChangeOperator
            .apply(src, Language::Python, 7)
            .unwrap();
        assert_eq!(
            a,
            Archetype::ChangeOperator
                .apply(src, Language::Python, 7)
                .unwrap()
        );
        let all: std::collections::BTreeSet<String> = (0..32)
            .map(|s| {
                Archetype::ChangeOperator
                    .apply(src, Language::Python, s)
                    .unwrap()
                    .edited
            })
            .collect();
        assert_eq!(all.len(), 3);
    }
}
