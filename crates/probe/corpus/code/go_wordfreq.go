package main

import (
	"fmt"
	"sort"
	"strings"
)

type wordCount struct {
	word  string
	count int
}

func normalize(text string) []string {
	lowered := strings.ToLower(text)
	cleaned := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r == ' ' {
			return r
		}
		return ' '
	}, lowered)
	return strings.Fields(cleaned)
}

func topWords(text string, limit int, minLen int) []wordCount {
	counts := map[string]int{}
	for _, w := range normalize(text) {
		if len(w) < minLen {
			continue
		}
		counts[w]++
	}
	ranked := make([]wordCount, 0, len(counts))
	for w, n := range counts {
		ranked = append(ranked, wordCount{w, n})
	}
	sort.Slice(ranked, func(i, j int) bool {
		if ranked[i].count != ranked[j].count {
			return ranked[i].count > ranked[j].count
		}
		return ranked[i].word < ranked[j].word
	})
	if len(ranked) > limit {
		ranked = ranked[:limit]
	}
	return ranked
}

func main() {
	text := "The cache keeps the keys; the keys expire, and the cache refills the keys."
	total := 0
	for _, wc := range topWords(text, 3, 3) {
		total += wc.count
		fmt.Printf("%-8s %d\n", wc.word, wc.count)
	}
	fmt.Println("top three cover", total, "words")
}
