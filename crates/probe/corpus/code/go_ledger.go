package main

import (
	"errors"
	"fmt"
	"sort"
)

type posting struct {
	account string
	cents   int64
}

var errUnbalanced = errors.New("transaction does not balance")

func balanced(postings []posting) bool {
	var sum int64
	for _, p := range postings {
		sum += p.cents
	}
	return sum == 0
}

func apply(ledger map[string]int64, postings []posting) error {
	if !balanced(postings) {
		return errUnbalanced
	}
	for _, p := range postings {
		ledger[p.account] += p.cents
	}
	return nil
}

func report(ledger map[string]int64) []string {
	names := make([]string, 0, len(ledger))
	for name := range ledger {
		names = append(names, name)
	}
	sort.Strings(names)
	lines := make([]string, 0, len(names))
	for _, name := range names {
		cents := ledger[name]
		lines = append(lines, fmt.Sprintf("%-10s %8.2f", name, float64(cents)/100))
	}
	return lines
}

func main() {
	ledger := map[string]int64{}
	rent := []posting{{"cash", -120000}, {"rent", 120000}}
	salary := []posting{{"income", -350000}, {"cash", 350000}}
	broken := []posting{{"cash", 500}}
	for _, tx := range [][]posting{rent, salary, broken} {
		if err := apply(ledger, tx); err != nil {
			fmt.Println("skipped:", err)
		}
	}
	for _, line := range report(ledger) {
		fmt.Println(line)
	}
}
