#[derive(Debug, Clone, PartialEq)]
enum Token {
    Number(f64),
    Ident(String),
    Op(char),
    LParen,
    RParen,
}

fn is_op(c: char) -> bool {
    matches!(c, '+' | '-' | '*' | '/' | '^')
}

fn read_number(chars: &[char], start: usize) -> (f64, usize) {
    let mut end = start;
    while end < chars.len() && (chars[end].is_ascii_digit() || chars[end] == '.') {
        end += 1;
    }
    let text: String = chars[start..end].iter().collect();
    (text.parse().unwrap_or(0.0), end)
}

fn tokenize(input: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = input.chars().collect();
    let mut tokens = Vec::new();
    let mut pos = 0;
    while pos < chars.len() {
        let c = chars[pos];
        if c.is_whitespace() {
            pos += 1;
        } else if c.is_ascii_digit() {
            let (value, next) = read_number(&chars, pos);
            tokens.push(Token::Number(value));
            pos = next;
        } else if c.is_alphabetic() {
            let start = pos;
            while pos < chars.len() && chars[pos].is_alphanumeric() {
                pos += 1;
            }
            tokens.push(Token::Ident(chars[start..pos].iter().collect()));
        } else if is_op(c) {
            tokens.push(Token::Op(c));
            pos += 1;
        } else if c == '(' || c == ')' {
            tokens.push(if c == '(' { Token::LParen } else { Token::RParen });
            pos += 1;
        } else {
            return Err(format!("unexpected {c:?} at {pos}"));
        }
    }
    Ok(tokens)
}

fn main() {
    let tokens = tokenize("rate * (base + 2.5) / 4").unwrap();
    println!("{} tokens: {:?}", tokens.len(), tokens);
}
