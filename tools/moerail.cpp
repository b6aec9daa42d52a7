#include <cstdio>
int main() { std::puts("moerail: placeholder"); return 0; }
