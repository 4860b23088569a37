// ESLint for the lab extension, as the JupyterLab extension template
// (jupyterlab/extension-template, template/eslint.config.mjs.jinja) sets it up:
// ESLint 9 flat config, typescript-eslint, @jupyter/eslint-plugin and Prettier.
// Tests (src/__tests__, ui-tests) get Prettier but not ESLint, as there: the
// type-aware parser reads tsconfig.json, which leaves them out.
import js from '@eslint/js';
import { defineConfig } from 'eslint/config';
import tseslint from 'typescript-eslint';
import prettierRecommended from 'eslint-plugin-prettier/recommended';
import globals from 'globals';
import jupyterPlugin from '@jupyter/eslint-plugin';

export default defineConfig([
  {
    ignores: [
      'node_modules',
      'lib',
      'dist',
      'coverage',
      '**/*.js',
      '**/*.d.ts',
      '.venv',
      'tests',
      '**/__tests__',
      'ui-tests'
    ]
  },
  js.configs.recommended,
  tseslint.configs.recommended,
  {
    plugins: {
      jupyter: jupyterPlugin
    }
  },
  jupyterPlugin.configs.recommended,
  // Before our rules, not after as in the template: its eslint-config-prettier
  // switches off every rule that may touch layout, curly and
  // prefer-arrow-callback included, so placed last it silently voids them.
  prettierRecommended,
  {
    files: ['**/*.ts', '**/*.tsx'],
    languageOptions: {
      globals: {
        ...globals.browser,
        ...globals.es2015,
        ...globals.node
      },
      parserOptions: {
        project: 'tsconfig.json',
        sourceType: 'module'
      }
    },
    rules: {
      '@typescript-eslint/naming-convention': [
        'error',
        {
          selector: 'interface',
          format: ['PascalCase'],
          custom: {
            regex: '^I[A-Z]',
            match: true
          }
        }
      ],
      '@typescript-eslint/no-unused-vars': ['warn', { args: 'none' }],
      '@typescript-eslint/no-explicit-any': 'off',
      '@typescript-eslint/no-namespace': 'off',
      '@typescript-eslint/no-use-before-define': 'off',
      // The template's '@typescript-eslint/quotes' is gone from typescript-eslint 8
      // (it was off there anyway): Prettier's singleQuote sets the quotes.
      curly: ['error', 'all'],
      eqeqeq: 'error',
      'prefer-arrow-callback': 'error'
    }
  }
]);
