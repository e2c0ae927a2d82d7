/// A bounded stack machine for a tiny postfix language.
struct Machine {
    stack: Vec<i64>,
    limit: usize,
    steps: u32,
}

impl Machine {
    fn new(limit: usize) -> Self {
        Machine { stack: Vec::with_capacity(limit), limit, steps: 0 }
    }

    fn push(&mut self, value: i64) -> Result<(), String> {
        if self.stack.len() >= self.limit {
            return Err("stack overflow".to_string());
        }
        self.stack.push(value);
        Ok(())
    }

    fn pop_pair(&mut self) -> Result<(i64, i64), String> {
        let right = self.stack.pop().ok_or("underflow")?;
        let left = self.stack.pop().ok_or("underflow")?;
        Ok((left, right))
    }

    fn run(&mut self, program: &str) -> Result<i64, String> {
        for word in program.split_whitespace() {
            self.steps += 1;
            match word {
                "+" | "-" | "*" => {
                    let (left, right) = self.pop_pair()?;
                    let result = match word {
                        "+" => left + right,
                        "-" => left - right,
                        _ => left * right,
                    };
                    self.push(result)?;
                }
                "dup" => {
                    let top = *self.stack.last().ok_or("empty")?;
                    self.push(top)?;
                }
                literal => {
                    let parsed: i64 = literal.parse().map_err(|_| format!("bad word {literal}"))?;
                    self.push(parsed)?;
                }
            }
        }
        self.stack.pop().ok_or_else(|| "no result".to_string())
    }
}

fn main() {
    let mut machine = Machine::new(16);
    let answer = machine.run("3 4 + dup * 2 -").unwrap();
    println!("answer {answer} after {} steps", machine.steps);
}
