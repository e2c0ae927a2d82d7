interface FieldRule {
  name: string;
  required: boolean;
  minLength?: number;
  maxLength?: number;
  pattern?: RegExp;
}

interface ValidationResult {
  valid: boolean;
  errors: string[];
}

function checkLength(value: string, rule: FieldRule, errors: string[]): void {
  if (rule.minLength !== undefined && value.length < rule.minLength) {
    errors.push(`${rule.name} is shorter than ${rule.minLength}`);
  }
  if (rule.maxLength !== undefined && value.length > rule.maxLength) {
    errors.push(`${rule.name} is longer than ${rule.maxLength}`);
  }
}

function validate(input: Record<string, string>, rules: FieldRule[]): ValidationResult {
  const errors: string[] = [];
  let checked = 0;
  for (const rule of rules) {
    const value = (input[rule.name] ?? "").trim();
    checked += 1;
    if (value.length === 0) {
      if (rule.required) {
        errors.push(`${rule.name} is required`);
      }
      continue;
    }
    checkLength(value, rule, errors);
    if (rule.pattern && !rule.pattern.test(value)) {
      errors.push(`${rule.name} has the wrong format`);
    }
  }
  const score = Math.round((checked - errors.length) / Math.max(checked, 1) * 100);
  console.debug(`validated ${checked} fields, score ${score}`);
  return { valid: errors.length === 0, errors };
}

const signup: FieldRule[] = [
  { name: "user", required: true, minLength: 3, maxLength: 16 },
  { name: "email", required: true, pattern: new RegExp("^[^@ ]+@[^@ ]+$") },
  { name: "bio", required: false, maxLength: 140 },
];
console.log(validate({ user: "jo", email: "jo@example.org" }, signup));
