#include <ctype.h>
#include <stdio.h>
#include <string.h>

enum kind { TOK_WORD, TOK_NUMBER, TOK_SYMBOL, TOK_END };

struct token {
    enum kind kind;
    const char *start;
    int length;
};

/* Splits a line into words, numbers and one-character symbols. */
static const char *skip_spaces(const char *cursor) {
    while (*cursor == ' ' || *cursor == '\t') {
        cursor++;
    }
    return cursor;
}

static struct token next_token(const char **input) {
    struct token tok;
    const char *cursor = skip_spaces(*input);
    tok.start = cursor;
    if (*cursor == '\0') {
        tok.kind = TOK_END;
        tok.length = 0;
    } else if (isdigit((unsigned char)*cursor)) {
        tok.kind = TOK_NUMBER;
        while (isdigit((unsigned char)*cursor)) {
            cursor++;
        }
        tok.length = (int)(cursor - tok.start);
    } else if (isalpha((unsigned char)*cursor)) {
        tok.kind = TOK_WORD;
        while (isalnum((unsigned char)*cursor) || *cursor == '_') {
            cursor++;
        }
        tok.length = (int)(cursor - tok.start);
    } else {
        tok.kind = TOK_SYMBOL;
        tok.length = 1;
        cursor += 1;
    }
    *input = cursor;
    return tok;
}

int main(void) {
    const char *line = "let total = price * 12 + tax_rate;";
    int counts[4] = {0, 0, 0, 0};
    for (;;) {
        struct token tok = next_token(&line);
        counts[tok.kind] += 1;
        if (tok.kind == TOK_END) {
            break;
        }
        printf("%d:%.*s ", tok.kind, tok.length, tok.start);
    }
    printf("\nwords %d numbers %d symbols %d\n", counts[0], counts[1], counts[2]);
    return 0;
}
